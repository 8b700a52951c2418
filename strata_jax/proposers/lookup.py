"""Prompt lookup / suffix matching: propose what followed the longest earlier match of the history's suffix.

Source: Strata's ``src/spec/suffix_drafter.cpp``: an n-gram (trigram) index over the history
(prompt + accepted output); the suffix's n-gram is looked up among its most recent earlier occurrences (16), each
match is extended backwards (at most 32 tokens), and the tokens that followed the longest match (the most recent one
on ties) are proposed, up to 5. Matches shorter than ``min_match`` (3) propose nothing. Costs microseconds per
window; pays on code edits and quoted text, where the output repeats the prompt.
"""

from __future__ import annotations

from strata_jax.proposers.base import Proposer


class LookupProposer(Proposer):
    """Suffix-match drafter over prompt + output.

    Args:
      min_match: shortest suffix match (in tokens) that proposes anything (>= 1; default 3).
      max_propose: most tokens proposed per window (default 5).
      recent: how many most recent earlier occurrences of the suffix n-gram are checked (default 16).
      max_extend: how far a match is extended backwards (default 32).

    Attributes:
      last_match: length of the match behind the last proposal (0 when none).
    """

    name = "lookup"
    host_side = True

    def __init__(self, min_match: int = 3, max_propose: int = 5, recent: int = 16, max_extend: int = 32):
        super().__init__()
        if min_match < 1:
            raise ValueError("min_match must be >= 1")
        self.min_match = int(min_match)
        self.n = min(self.min_match, 3)  # n-gram size of the index
        self.max_propose = int(max_propose)
        self.recent = int(recent)
        self.max_extend = max(int(max_extend), self.min_match)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._hist: list[int] = []
        self._index: dict[tuple, list[int]] = {}
        self.last_match = 0

    def _sync(self, history: list[int]) -> None:
        """Extend the index to ``history`` (rebuilt when it is not an extension of what was indexed)."""
        m = len(self._hist)
        if len(history) < m or history[:m] != self._hist:
            self._hist, self._index, m = [], {}, 0
        n = self.n
        for i in range(max(m + 1, n), len(history) + 1):
            # the n-gram history[i-n:i]; i is the index of the token that followed it
            self._index.setdefault(tuple(history[i - n:i]), []).append(i)
        self._hist = list(history)

    def propose(self, history_ids, max_n, min_p=0.0):
        """Tokens that followed the longest earlier match of the history's suffix (see the module doc)."""
        self.last_probs = None
        self.last_match = 0
        h = list(history_ids)
        self._sync(h)
        L = len(h)
        k = min(int(max_n), self.max_propose)
        if k <= 0 or L < self.n + 1:
            return []
        occ = self._index.get(tuple(h[L - self.n:]), [])
        best_len, best_i = 0, -1
        checked = 0
        for i in reversed(occ):
            if i >= L:
                continue  # the suffix itself
            checked += 1
            if checked > self.recent:
                break
            ln = self.n
            while ln < self.max_extend and i - ln - 1 >= 0 and h[i - ln - 1] == h[L - ln - 1]:
                ln += 1
            if ln > best_len:
                best_len, best_i = ln, i
        if best_len < self.min_match:
            return []
        self.last_match = best_len
        return h[best_i:best_i + k]
