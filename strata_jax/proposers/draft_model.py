"""Draft-model proposals: a smaller GGUF with the same tokenizer drafts greedily with its own engine and K/V cache.

Each round the draft engine first catches up on the tokens the target accepted since its last round (the longest
common prefix of what it has read and the history is kept; for dense models the K/V cells past it are simply
overwritten), reading the new tail in one window (or as a prefill when the tail is longer than a
window, e.g. the prompt), then chains greedy drafts one step at a time. With ``min_p`` it stops at the first draft
whose probability under the draft model is below it (``--spec_min_p``).

The draft must share the target's tokenizer: same vocabulary size and the same token strings, else proposals
would be meaningless ids; a mismatch raises `StrataError`. Draft models with recurrent state (hybrids) are refused:
their committed drafts could not be rolled back.
"""

from __future__ import annotations

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
      engine: the draft model's Engine (dense; ``max_context`` at least the target's). It may be the target engine
        itself when ``slot`` is a slot the target sequence does not use (self-drafting, for tests).
      target: the target Engine; when given, its tokenizer must match the draft's (`check_same_tokenizer`).
      slot: the draft engine's slot holding the draft sequence.
      window: rows of the catch-up window (use the target's ``--spec`` so a self-draft reuses its compile).

    Attributes:
      draft_seconds: wall time spent in the draft engine.
      draft_calls: draft engine calls (catch-up windows, prefills and steps).

    Raises:
      StrataError: different tokenizer, hybrid draft model, or a draft context shorter than the target's.
    """

    name = "model"

    def __init__(self, engine, target=None, *, slot: int = 0, window: int = 4):
        super().__init__()
        if engine.family.recurrent:
            raise StrataError(f"draft model {engine.gguf.path}: architecture {engine.cfg.arch!r} has recurrent state "
                              f"and cannot draft (use a dense model with the same tokenizer)")
        if target is not None and target is not engine:
            check_same_tokenizer(target, engine)
            if engine.max_context < target.max_context:
                raise StrataError(f"draft model context {engine.max_context} is shorter than the target's "
                                  f"{target.max_context}")
        if not 0 <= slot < engine.n_slots:
            raise StrataError(f"draft slot {slot} outside the draft engine's {engine.n_slots} slots")
        self.engine = engine
        self.target_vocab = target.cfg.vocab_size if target is not None else engine.cfg.vocab_size
        self.slot = int(slot)
        self.window = max(int(window), 1)
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
        self.fed: list[int] = []  # tokens in the draft's cache at positions 0..len-1

    def bind(self, slot: int) -> None:
        """Draft in the draft engine's ``slot`` from now on (batch slots: one per request; forgets the cache).

        Raises:
          StrataError: a slot the draft engine does not have.
        """
        if not 0 <= int(slot) < self.engine.n_slots:
            raise StrataError(f"draft slot {slot} outside the draft engine's {self.engine.n_slots} slots")
        self.slot = int(slot)
        self.reset()

    def fork(self) -> "DraftModelProposer":
        """Another proposer on the same draft engine (and its compiled functions), for another request."""
        other = object.__new__(type(self))
        Proposer.__init__(other)
        other.engine, other.target_vocab, other.slot, other.window = self.engine, self.target_vocab, self.slot, \
            self.window
        other._samp, other.draft_seconds, other.draft_calls = self._samp, 0.0, 0
        other.reset()
        return other

    @staticmethod
    def _prob(logits_row) -> float:
        return float(jnp.max(jax.nn.softmax(logits_row)))

    def _feed_tail(self, start: int, tail: list[int], want_p: bool) -> tuple[int, float]:
        """Read ``tail`` at positions ``start..``; returns the greedy pick after it and its probability."""
        eng = self.engine
        self.draft_calls += 1
        if len(tail) > self.window:
            pick, lg = eng.prefill(self.slot, tail, _GREEDY, start=start, all_logits=want_p)
            p = self._prob(lg[-1]) if want_p else 1.0
            return pick, p
        n = len(tail)
        toks = np.zeros((1, self.window), np.int32)
        toks[0, :n] = tail
        rows = Rows.make([self.slot], [start], [n])
        res = eng.window(toks, rows, self._samp, kind="window")
        if any(pd is not None for pd in res.pending):
            eng.commit(rows, res.pending, np.array([n], np.int32))
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
        import time

        t0 = time.perf_counter()
        self.last_probs = []
        h = list(history_ids)
        if max_n <= 0 or not h:
            self.last_probs = []
            return []
        c = 0
        m = min(len(self.fed), len(h) - 1)  # always re-read at least the last token to get its pick
        while c < m and self.fed[c] == h[c]:
            c += 1
        max_pos = self.engine.max_context - 2  # last position the draft may read
        if len(h) - 1 > max_pos:
            return []
        want_p = min_p > 0
        tail = h[c:]
        pick, p = self._feed_tail(c, tail, want_p)
        self.fed = h[:]
        drafts, probs = [], []
        while True:
            if want_p and p < min_p:
                break
            if pick >= self.target_vocab:
                break
            drafts.append(pick)
            probs.append(p)
            pos = len(self.fed)
            if len(drafts) >= max_n or pos > max_pos:
                break
            pick, p = self._step(pick, pos, want_p)
            self.fed.append(drafts[-1])
        self.last_probs = probs
        self.draft_seconds += time.perf_counter() - t0
        return drafts
