"""One sequence on the host: the tokens it has emitted, the stop rule, and the trimming of its proposals.

The solo loops (`strata_jax.pipeline.solo.generate`) and the batch scheduler (`strata_jax.pipeline.scheduler`) both
move a sequence forward through `Sequence`, so a batch row stops exactly where the solo run stops:

* `Sequence.emit` appends one token and applies the stop rule, in plain decoding's order: an EOS id ends the
  generation (kept in ``tokens``, not streamed); otherwise the token is streamed (``on_token``), then a stop string
  (``stop`` callback), ``max_new_tokens`` and the context end are checked.
* The same rule in two phases, so that a loop can launch the next window between them (the host's streaming and
  stop-string work then runs while the device computes): `Sequence.push` appends a token and applies the checks
  that need no text (EOS, ``max_new_tokens``, the context end); `Sequence.flush` then streams the pushed tokens
  and checks the stop strings, token by token. A stop string found in the flush drops the tokens pushed after the
  one that completed it, so ``push``, ..., ``push``, ``flush`` ends exactly where ``emit``, ..., ``emit`` ends.
* `Sequence.propose` asks the proposer for at most `Sequence.room` tokens (what the window cap, ``max_new_tokens``
  and the context leave) and cuts the proposal at the first token whose proposer probability is below
  ``spec_min_p``.
* `Sequence.accept` emits a verify window's result: the accepted proposals (``n_keep - 1``) and
  the bonus pick, cut where the stop rule ends the sequence; the proposer observes the kept tokens
  (`Sequence.push_window` is its push phase).
"""

from __future__ import annotations

from typing import Callable

STOP_REASONS = ("eos", "stop string", "max tokens", "context end")


class Sequence:
    """The host-side state of one generation.

    Args:
      prompt_ids: the prompt's token ids (non-empty).
      max_new_tokens: most tokens generated (>= 1).
      max_context: the engine's cells per slot (prompt + generated).
      eos_ids: ids that end the generation (kept in ``tokens``, not streamed).
      stop: ``stop(tokens) -> bool`` called after each streamed token (stop strings, `stop_strings`).
      on_token: ``on_token(token_id)`` for each streamed token.
      proposer: a `strata_jax.proposers.Proposer` (None: no proposals).
      spec_min_p: cut proposals at the first one whose proposer probability is below it (0 = off).
      tokens: the list to append the generated ids to (the batch scheduler passes its `RequestResult`'s; default a
        new list).

    Attributes:
      tokens: the generated ids (list[int]; EOS included when it ended the generation).
      history: prompt + tokens (what a proposer sees; its last entry is row 0 of the next window).
      reason: '' while running, else one of `STOP_REASONS`.
      n_flushed: how many of ``tokens`` `flush` has handled (streamed and checked against the stop strings); the
        rest are pushed and waiting.
    """

    def __init__(self, prompt_ids, *, max_new_tokens: int, max_context: int, eos_ids=(),
                 stop: Callable[[list[int]], bool] | None = None, on_token: Callable[[int], None] | None = None,
                 proposer=None, spec_min_p: float = 0.0, tokens: list | None = None):
        self.n_prompt = len(prompt_ids)
        self.history = list(prompt_ids)
        self.tokens: list[int] = tokens if tokens is not None else []
        self.max_new_tokens = int(max_new_tokens)
        self.max_context = int(max_context)
        self.eos = frozenset(int(e) for e in eos_ids)
        self.stop = stop
        self.on_token = on_token
        self.proposer = proposer
        self.spec_min_p = float(spec_min_p)
        self.reason = ""
        self.n_flushed = len(self.tokens)

    @property
    def pos(self) -> int:
        """Position of the next window's row 0 (the last emitted token)."""
        return self.n_prompt + len(self.tokens) - 1

    @property
    def last(self) -> int:
        """The last emitted token (row 0 of the next window)."""
        return self.tokens[-1]

    def emit(self, tok: int) -> str:
        """Append ``tok`` and apply the stop rule (`push` then `flush`); returns the stop reason ('' while the
        sequence goes on)."""
        self.push(tok)
        return self.flush()

    def push(self, tok: int) -> str:
        """Append ``tok`` and apply the checks that need no text: an EOS id, ``max_new_tokens``, the context end.
        Streaming and the stop strings wait for `flush`. Returns the stop reason found so far ('' while the sequence
        may go on; a `flush` may still end it earlier, at a stop string).

        Raises:
          RuntimeError: the sequence has already ended (a push after the stop rule ended it).
        """
        if self.reason:
            raise RuntimeError(f"push after the sequence ended ({self.reason})")
        tok = int(tok)
        self.tokens.append(tok)
        self.history.append(tok)
        if tok in self.eos:
            self.reason = "eos"
        elif len(self.tokens) >= self.max_new_tokens:
            self.reason = "max tokens"
        elif self.pos >= self.max_context - 1:
            self.reason = "context end"
        return self.reason

    def flush(self) -> str:
        """Stream the pushed tokens (``on_token``; an EOS that ended the sequence is not streamed) and check the
        stop strings after each, in order. A stop string completed by a token ends the sequence there: the tokens
        pushed after it are dropped from ``tokens`` and ``history`` and the reason becomes ``stop string`` (plain
        decoding checks the stop strings before ``max_new_tokens`` and the context end, and never produced the
        later tokens). Returns the stop reason ('' while the sequence goes on)."""
        n = len(self.tokens)
        for j in range(self.n_flushed, n):
            tok = self.tokens[j]
            if j == n - 1 and self.reason == "eos":
                break  # the EOS that ended the sequence: kept, not streamed
            if self.on_token is not None:
                self.on_token(tok)
            if self.stop is not None and self.stop(self.tokens if j == n - 1 else self.tokens[:j + 1]):
                del self.tokens[j + 1:]
                del self.history[self.n_prompt + j + 1:]
                self.reason = "stop string"
                break
        self.n_flushed = len(self.tokens)
        return self.reason

    @property
    def budget(self) -> int:
        """Most tokens the sequence may still emit before ``max_new_tokens`` or the context end (an EOS or a stop
        string may end it sooner); 0 once it has ended."""
        if self.reason:
            return 0
        return max(0, min(self.max_new_tokens - len(self.tokens), self.max_context - 1 - self.pos))

    def room(self, cap: int, ahead: int = 0) -> int:
        """Most proposals the next window may carry: ``cap``, and no more than the tokens ``max_new_tokens`` and the
        context leave after the window's bonus token (>= 0). ``ahead``: the same once ``ahead`` more tokens have been
        emitted (a loop planning a window before the previous one is read)."""
        n, pos = len(self.tokens) + ahead, self.pos + ahead
        return max(0, min(int(cap), self.max_new_tokens - n - 1, self.max_context - 2 - pos))

    def propose(self, cap: int) -> list[int]:
        """Up to `room(cap)` proposals from the proposer, cut at the first probability below ``spec_min_p`` (proposers
        without probabilities are not cut). Empty without a proposer or room."""
        n = self.room(cap)
        if n <= 0 or self.proposer is None:
            return []
        props = [int(t) for t in self.proposer.propose(list(self.history), n, self.spec_min_p)][:n]
        probs = self.proposer.last_probs
        if self.spec_min_p > 0 and probs is not None:
            n_ok = 0
            while n_ok < len(props) and n_ok < len(probs) and probs[n_ok] >= self.spec_min_p:
                n_ok += 1
            props = props[:n_ok]
        return props

    def push_window(self, props: list[int], picks, n_keep: int) -> list[int]:
        """The push phase of `accept`: push ``props[:n_keep - 1]`` then the bonus ``picks[n_keep - 1]`` (``picks``:
        the segment's picks, one per row), stopping at the first token that ends the sequence by `push`'s checks.
        ``n_keep`` is 1 for a window without proposals. The proposer observes the pushed tokens; returns them."""
        n_keep = int(n_keep) if props else 1
        emitted = list(props[:n_keep - 1]) + [int(picks[n_keep - 1])]
        kept = []
        for t in emitted:
            kept.append(int(t))
            if self.push(t):
                break
        if self.proposer is not None:
            self.proposer.observe(kept)
        return kept

    def accept(self, props: list[int], picks, n_keep: int) -> list[int]:
        """Emit a window's result: `push_window`, then `flush`; returns the tokens kept (a stop string found in the
        flush cuts them)."""
        n0 = len(self.tokens)
        self.push_window(props, picks, n_keep)
        self.flush()
        return self.tokens[n0:]


def stop_strings(tokenizer, strings) -> Callable[[list[int]], bool] | None:
    """The ``stop`` callback of a `Sequence` for stop strings: True once the decoded text of the tokens so far
    contains one of ``strings`` (the token that completes it is kept, as llama.cpp's ``--stop`` keeps the matched
    text). None when ``strings`` is empty."""
    strings = [s for s in (strings or ()) if s]
    if not strings:
        return None

    def stop(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens, skip_special=True)
        return any(s in text for s in strings)

    return stop
