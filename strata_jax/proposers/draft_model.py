"""Draft-model proposals: a smaller GGUF with the same tokenizer drafts greedily with its own engine and state.

Each round the draft engine first catches up on the tokens the target accepted since its last round, then chains
greedy drafts. With ``min_p`` it stops at the first draft whose probability under the draft model is below it
(``--spec_min_p``). How the draft's state follows the verdicts depends on the draft model:

* Dense drafts (K/V cells only): the longest common prefix of what the draft has read and the history is kept; the
  cells past it are simply overwritten. The new tail is read in one window (or as a prefill when it
  is longer than a window, e.g. the prompt) and every draft is a one-row step.
* Drafts with recurrent state (GDN state, conv and PLE histories: families with ``recurrent=True`` in
  `strata_jax.models.registry`, e.g. qwen35moe, qwen3next, qwen4exp): a draft read into that state cannot be taken
  back, so the draft runs verify windows of its own and commits them as the target does
  (`strata_jax.pipeline.engine.Engine.window` / `Engine.commit`). Draft k comes from a window over the uncommitted
  tail of the history plus drafts 1..k-1 (uncommitted: the window leaves the recurrent state alone); the last such
  window stays open until the target's verdict is known. The next round reads the verdict off the history (the
  window's rows that the history kept: the tail and the accepted drafts) and commits exactly those rows
  (`Engine.commit` with that keep count), so the draft's state holds the kept prefix and nothing of the rejected
  drafts. A tail that would not fit in a window beside the drafts (the prompt, or rounds the proposer sat out) is
  read and committed first.

The draft must share the target's tokenizer: same vocabulary size and the same token strings, else proposals
would be meaningless ids; a mismatch raises `StrataError`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.errors import StrataError
from strata_jax.proposers.base import Proposer
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows

_GREEDY = SamplingParams(temperature=0.0)


def check_same_tokenizer(target, draft) -> None:
    """Raise `StrataError` unless ``draft`` (an Engine) tokenizes exactly like ``target`` (an Engine).

    Compares the tokenizers' vocabulary sizes and every token string.
    """
    try:
        tt, dt = target.tokenizer, draft.tokenizer
    except Exception as e:  # noqa: BLE001 - a file without tokenizer metadata
        raise StrataError(f"draft model {draft.gguf.path}: cannot compare tokenizers ({e})") from None
    if tt.vocab_size != dt.vocab_size:
        raise StrataError(f"draft model {draft.gguf.path} has a different tokenizer: vocabulary of {dt.vocab_size} "
                          f"tokens, the target has {tt.vocab_size}")
    for i in range(tt.vocab_size):
        a, b = tt.id_to_token(i), dt.id_to_token(i)
        if a != b:
            raise StrataError(f"draft model {draft.gguf.path} has a different tokenizer: token {i} is {b!r}, "
                              f"the target's is {a!r}")


class DraftModelProposer(Proposer):
    """Greedy drafts from a second (smaller) engine.

    Args:
      engine: the draft model's Engine (any family; ``max_context`` at least the target's). It may be the target
        engine itself when ``slot`` is a slot the target sequence does not use (self-drafting, for tests).
      target: the target Engine; when given, its tokenizer must match the draft's (`check_same_tokenizer`).
      slot: the draft engine's slot holding the draft sequence.
      window: rows of the draft's windows (use the target's ``--spec`` so a self-draft reuses its compile); a draft
        with recurrent state proposes at most this many tokens per round.

    Attributes:
      recurrent: the draft model has recurrent state (its windows are committed after each verdict).
      on_target: the draft engine is the target engine (self-drafting in another slot).
      draft_seconds: wall time spent in the draft engine.
      draft_calls: draft engine calls (windows, prefills, steps; commits not counted).

    Raises:
      StrataError: different tokenizer, or a draft context shorter than the target's.
    """

    name = "model"

    def __init__(self, engine, target=None, *, slot: int = 0, window: int = 4):
        super().__init__()
        if target is not None and target is not engine:
            check_same_tokenizer(target, engine)
            if engine.max_context < target.max_context:
                raise StrataError(f"draft model context {engine.max_context} is shorter than the target's "
                                  f"{target.max_context}")
        if not 0 <= slot < engine.n_slots:
            raise StrataError(f"draft slot {slot} outside the draft engine's {engine.n_slots} slots")
        self.engine = engine
        self.on_target = target is engine
        self.target_vocab = target.cfg.vocab_size if target is not None else engine.cfg.vocab_size
        self.slot = int(slot)
        self.window = max(int(window), 1)
        self.recurrent = bool(engine.family.recurrent)
        self._samp = RowSampling.make([_GREEDY])
        self.draft_seconds = 0.0
        self.draft_calls = 0
        self.reset()

    @classmethod
    def load(cls, path, target, *, window: int = 4, **engine_kwargs) -> "DraftModelProposer":
        """Load the draft GGUF at ``path`` with the target's context and check its tokenizer."""
        from strata_jax.pipeline.engine import Engine

        eng = Engine(path, max_context=target.max_context, **engine_kwargs)
        return cls(eng, target, window=window)

    def reset(self) -> None:
        super().reset()
        self.fed: list[int] = []  # tokens in the draft slot's state at positions 0..len-1 (recurrent: committed)
        self._open = None  # recurrent drafts: (tokens, rows, pending) of the last window, not committed yet

    def bind(self, slot: int) -> None:
        """Draft in the draft engine's ``slot`` from now on (the target's slot: batch slots draft one per request)
        and forget the sequence. A proposer drafting on the target engine itself keeps its own slot (``slot`` holds
        the target's sequence).

        Raises:
          StrataError: a slot the draft engine does not have.
        """
        if not self.on_target:
            if not 0 <= int(slot) < self.engine.n_slots:
                raise StrataError(f"draft slot {slot} outside the draft engine's {self.engine.n_slots} slots")
            self.slot = int(slot)
        self.reset()

    def fork(self) -> "DraftModelProposer":
        """Another proposer on the same draft engine (and its compiled functions), for another request."""
        other = object.__new__(type(self))
        Proposer.__init__(other)
        for k in ("engine", "on_target", "target_vocab", "slot", "window", "recurrent", "_samp"):
            setattr(other, k, getattr(self, k))
        other.draft_seconds, other.draft_calls = 0.0, 0
        other.reset()
        return other

    @staticmethod
    def _prob(logits_row) -> float:
        return float(jnp.max(jax.nn.softmax(logits_row)))

    def _rows(self, start: int, tokens: list[int]) -> tuple[np.ndarray, Rows]:
        """A [1, window] window of ``tokens`` at positions ``start..`` (padded rows invalid)."""
        toks = np.zeros((1, self.window), np.int32)
        toks[0, :len(tokens)] = tokens
        return toks, Rows.make([self.slot], [start], [len(tokens)])

    def _feed(self, start: int, tail: list[int], want_p: bool) -> tuple[int, float]:
        """Read and commit ``tail`` at positions ``start..`` (a sequence start zeroes the slot first); returns the
        greedy pick after it and its probability."""
        eng = self.engine
        self.draft_calls += 1
        if len(tail) > self.window:
            pick, lg = eng.prefill(self.slot, tail, _GREEDY, start=start, all_logits=want_p)
            return pick, (self._prob(lg[-1]) if want_p else 1.0)
        if start == 0:
            eng.reset_slot(self.slot)
        toks, rows = self._rows(start, tail)
        res = eng.window(toks, rows, self._samp, kind="window")
        if any(pd is not None for pd in res.pending):
            eng.commit(rows, res.pending, np.array([len(tail)], np.int32))
        n = len(tail)
        p = self._prob(res.device_out["logits"][0, n - 1]) if want_p else 1.0
        return int(res.picks[0, n - 1]), p

    def _step(self, token: int, pos: int, want_p: bool) -> tuple[int, float]:
        self.draft_calls += 1
        res = self.engine.window(np.array([[token]], np.int32), Rows.make([self.slot], [pos], [1]), self._samp,
                                 kind="step")
        p = self._prob(res.device_out["logits"][0, 0]) if want_p else 1.0
        return int(res.picks[0, 0]), p

    def propose(self, history_ids, max_n, min_p=0.0):
        """Catch up on ``history_ids`` and draft up to ``max_n`` tokens greedily (see the module doc)."""
        t0 = time.perf_counter()
        self.last_probs = []
        h = [int(t) for t in history_ids]
        if max_n <= 0 or not h:
            return []
        max_pos = self.engine.max_context - 2  # last position the draft may read
        if len(h) - 1 > max_pos:
            return []
        if self.recurrent:
            drafts, probs = self._propose_windows(h, int(max_n), float(min_p), max_pos)
        else:
            drafts, probs = self._propose_steps(h, int(max_n), float(min_p), max_pos)
        self.last_probs = probs
        self.draft_seconds += time.perf_counter() - t0
        return drafts

    def _keep(self, pick: int, p: float, min_p: float) -> bool:
        """Whether a greedy pick becomes a draft: probability at least ``min_p`` and an id the target knows."""
        return not (min_p > 0 and p < min_p) and pick < self.target_vocab

    def _propose_steps(self, h, max_n, min_p, max_pos):
        """Dense drafts: keep the common prefix, read the new tail, then one-row steps."""
        c = 0
        m = min(len(self.fed), len(h) - 1)  # always re-read at least the last token to get its pick
        while c < m and self.fed[c] == h[c]:
            c += 1
        want_p = min_p > 0
        pick, p = self._feed(c, h[c:], want_p)
        self.fed = h[:]
        drafts, probs = [], []
        while self._keep(pick, p, min_p):
            drafts.append(pick)
            probs.append(p)
            pos = len(self.fed)
            if len(drafts) >= max_n or pos > max_pos:
                break
            pick, p = self._step(pick, pos, want_p)
            self.fed.append(drafts[-1])
        return drafts, probs

    def _settle(self, h: list[int]) -> None:
        """Recurrent drafts: commit the open window's rows that ``h`` kept (never its last token, which the next
        window reads); start the sequence over when ``h`` does not extend what was committed."""
        s = len(self.fed)
        if self._open is not None:
            toks, rows, pending = self._open
            self._open = None
            if h[:s] == self.fed:
                keep, lim = 0, min(len(toks), len(h) - 1 - s)
                while keep < lim and toks[keep] == h[s + keep]:
                    keep += 1
                self.engine.commit(rows, pending, np.array([keep], np.int32))
                self.fed += toks[:keep]
        if len(self.fed) > len(h) - 1 or h[:len(self.fed)] != self.fed:
            self.fed = []  # a new sequence (the slot is zeroed when it is read from position 0)

    def _propose_windows(self, h, max_n, min_p, max_pos):
        """Recurrent drafts: settle the last verdict, then one window per draft over the uncommitted tail."""
        self._settle(h)
        eng = self.engine
        s = len(self.fed)
        n = min(max_n, self.window, max_pos - len(h) + 2)  # draft k's window ends at position len(h) - 2 + k
        if len(h) - s + n - 1 > self.window:  # the tail does not fit beside the drafts: commit all but its last token
            self._feed(s, h[s:-1], False)
            self.fed = h[:-1]
            s = len(h) - 1
        elif s == 0:
            eng.reset_slot(self.slot)
        run = h[s:]
        want_p = min_p > 0
        drafts, probs = [], []
        while True:
            self.draft_calls += 1
            toks, rows = self._rows(s, run)
            res = eng.window(toks, rows, self._samp, kind="window")
            self._open = (list(run), rows, res.pending)
            pick = int(res.picks[0, len(run) - 1])
            p = self._prob(res.device_out["logits"][0, len(run) - 1]) if want_p else 1.0
            if not self._keep(pick, p, min_p):
                break
            drafts.append(pick)
            probs.append(p)
            if len(drafts) >= n:
                break
            run.append(pick)
        return drafts, probs
