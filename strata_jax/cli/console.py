"""What the commands write: generated text on stdout, notes (warnings, compile lines, log records, the stats line)
on stderr, and never a note inside a line of text.

Text is flushed as it is written. When stdout and stderr reach the same terminal, file or pipe (``2>&1``), a note
written while a line of text is open starts on a new line (the line break goes to stderr: stdout's text is not
changed, and it goes on after the note); compile lines are not shown there at all (`Console.compile_notifier`).
`Console.guard_logging` applies the same rule to log records (``--verbose``).

`LabelledLines` is the batch output of ``strata-generate --prompts_file``: each request's text streamed as whole
lines labelled with its id (`LabelledLines` documents the format).
"""

from __future__ import annotations

import os
import sys
import threading


def _same_stream(a, b) -> bool:
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (OSError, ValueError, AttributeError):
        return a is b


def id_text():
    """A token-id renderer for models without a usable tokenizer: ``f(t) -> str`` gives ``"t"`` for the first id
    and ``" t"`` after it, so a stream of ids reads ``1 2 3`` with no trailing space."""
    sep = [""]

    def render(t: int) -> str:
        out, sep[0] = f"{sep[0]}{t}", " "
        return out
    return render


class Console:
    """stdout for text, stderr for notes (see the module doc). Thread-safe: compile lines come from a timer thread.

    Args:
      out, err: the streams (default: ``sys.stdout`` / ``sys.stderr`` at each write, so a redirection made after
        construction is followed).
    """

    def __init__(self, out=None, err=None):
        self._out, self._err = out, err
        self._lock = threading.RLock()
        self.text_open = False      # the last text written did not end a line
        self._pending = None        # a note waiting for its end (`begin_note` / `end_note`)
        self._dropped = None        # a note not shown (`begin_note` with ``quiet_in_text``)

    @property
    def out(self):
        return self._out or sys.stdout

    @property
    def err(self):
        return self._err or sys.stderr

    def text(self, s: str) -> None:
        """Write generated text to stdout, flushed."""
        if not s:
            return
        with self._lock:
            if _same_stream(self.out, self.err):
                self._close_pending()  # a pending "compiling ..." note would get the text on its line
            self.out.write(s)
            self.out.flush()
            self.text_open = not s.endswith("\n")

    def end_text(self) -> None:
        """End the open line of text, if any (a newline on stdout)."""
        with self._lock:
            if self.text_open:
                self.out.write("\n")
                self.out.flush()
                self.text_open = False

    def _break(self) -> None:
        """Before a note: flush the text, and start a new line where text and notes share the stream."""
        try:
            self.out.flush()
        except (OSError, ValueError):
            pass
        if self.text_open and _same_stream(self.out, self.err):
            self.err.write("\n")
            self.text_open = False

    def _close_pending(self) -> None:
        if self._pending is not None:
            self.err.write("\n")
            self.err.flush()
            self._pending = None

    def note(self, line: str) -> None:
        """Write one line to stderr, on a line of its own."""
        with self._lock:
            self._close_pending()
            self._break()
            self.err.write(line.rstrip("\n") + "\n")
            self.err.flush()

    def begin_note(self, key, line: str, quiet_in_text: bool = False) -> None:
        """Start a note that `end_note` completes on the same line (``compiling ... 12.3 s``). With
        ``quiet_in_text`` the note is dropped (with its end) while a line of text is open on the same stream."""
        with self._lock:
            if quiet_in_text and self.text_open and _same_stream(self.out, self.err):
                self._dropped = key
                return
            self._close_pending()
            self._break()
            self.err.write(line)
            self.err.flush()
            self._pending = key

    def end_note(self, key, tail: str, alone: str) -> None:
        """Complete the note of ``key`` with ``tail``; when something else was written meanwhile, write ``alone``
        as a line of its own instead."""
        with self._lock:
            if self._dropped == key:
                self._dropped = None
            elif self._pending == key:
                self.err.write(tail + "\n")
                self.err.flush()
                self._pending = None
            else:
                self.note(alone)

    def compile_notifier(self, n_stages: int = 1, label: str = "", xla=None):
        """A `strata_jax.pipeline.windows.CompileCache` ``notify`` callback: ``compiling decode step (1 slot) ...
        12.3 s`` on stderr for a compile that takes more than the cache's ``notice_after`` seconds; with ``xla``
        (the process's `XlaCacheStats`), a first call during which programs were read from the persistent cache and
        none written ends ``... 1.2 s (read from the XLA cache)``. Not shown while a line of text is open on the same terminal (a
        compile after the first token of a stream: the stats line counts it), so the streamed text stays in one
        piece."""
        from strata_jax.pipeline.windows import describe_key

        import time

        def notify(key, seconds):
            what = label + describe_key(key, n_stages)
            if seconds is None:
                self.begin_note(("compile", key), f"compiling {what} ...", quiet_in_text=True)
                return
            read = xla is not None and xla.only_read_since(time.perf_counter() - seconds)  # since the call began
            how = " (read from the XLA cache)" if read else ""
            self.end_note(("compile", key), f" {seconds:.1f} s{how}", f"compiled {what} in {seconds:.1f} s{how}")

        return notify

    def guard_logging(self) -> None:
        """Log records (absl's handler and any other on the root logger) start on a line of their own."""
        import logging

        def guard(record) -> bool:
            with self._lock:
                self._close_pending()
                self._break()
            return True

        for h in logging.getLogger().handlers:
            if guard not in h.filters:
                h.addFilter(guard)


CONSOLE = Console()


class LabelledLines:
    """The batch output of ``strata-generate --prompts_file``: each request's text as it is generated, as whole lines
    labelled with the request's id, so two requests never share a line.

    Format: ``[ID] TEXT`` for each line of a request's text, printed as soon as the request has generated the line's
    end (a newline, or the end of the request). A line longer than ``width`` characters is printed in pieces cut
    after a space (or at ``width`` when there is none); each piece after the first is labelled ``[ID]+`` (it continues
    the previous line of that request, without a line break in the text). A request that generates no text prints
    ``[ID]`` alone. ``--out_jsonl`` has each request's exact text.

    Args:
      console: where the lines go (stdout).
      width: longest piece of a line held back.
    """

    def __init__(self, console: Console = CONSOLE, width: int = 100):
        self.console = console
        self.width = int(width)
        self._buf: dict = {}        # rid -> text of the open line not printed yet
        self._cont: dict = {}       # rid -> the open line has a printed piece already
        self._printed: set = set()

    def _emit(self, rid, piece: str, cont: bool) -> None:
        label = f"[{rid}]+" if cont else f"[{rid}]"
        self.console.text(f"{label} {piece}\n" if piece else f"{label}\n")
        self._printed.add(rid)

    def feed(self, rid, s: str) -> None:
        """Text ``s`` of request ``rid``: prints the lines it completes and the pieces of an overlong line."""
        buf = self._buf.get(rid, "") + s
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            self._emit(rid, line, self._cont.pop(rid, False))
        while len(buf) > self.width:
            cut = buf.rfind(" ", 0, self.width) + 1 or self.width
            self._emit(rid, buf[:cut], self._cont.get(rid, False))
            self._cont[rid] = True
            buf = buf[cut:]
        self._buf[rid] = buf

    def finish(self, rid, s: str = "") -> None:
        """The end of request ``rid`` (with its last text ``s``): prints what is left of its last line."""
        self.feed(rid, s)
        buf = self._buf.pop(rid, "")
        cont = self._cont.pop(rid, False)
        if buf or rid not in self._printed:
            self._emit(rid, buf, cont)


PROMPT_BAR_MIN_CHUNKS = 4  # a prompt of more chunks than this gets a progress line


def prompt_progress(n_tokens: int, chunk: int, file=None, min_chunks: int = PROMPT_BAR_MIN_CHUNKS):
    """An ``on_chunk(read, total)`` callback for `strata_jax.pipeline.engine.Engine.prefill` that shows ``reading
    prompt: 8192/32768 [00:05<00:15, 1638.40 tok/s]`` on ``file`` (default stderr; a terminal only, as the load bar;
    cleared at the end) while a prompt of more than ``min_chunks`` chunks of ``chunk`` tokens is read; None for a
    shorter prompt. The line starts after the first chunk (which compiles the prefill program and announces it), so
    its rate is that of the warm chunks. Never writes to stdout."""
    if -(-int(n_tokens) // int(chunk)) <= min_chunks:
        return None
    bar = None

    def on_chunk(read: int, total: int) -> None:
        nonlocal bar
        from tqdm import tqdm

        if bar is None:
            if read >= total:
                return
            bar = tqdm(total=total, initial=read, desc="reading prompt", unit=" tok", file=file or sys.stderr,
                       leave=False, disable=None, dynamic_ncols=True)
            return
        bar.update(read - bar.n)
        if read >= total:
            bar.close()

    return on_chunk
