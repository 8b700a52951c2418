"""The proposer interface: where the drafts of a speculative window come from.

A proposer sees the sequence's history (prompt + accepted output, the last entry being the token that will be row 0
of the next window) and proposes up to ``max_n`` tokens that it guesses come next. The target verifies them by exact
match, so a proposer can only change the speed, never the output.
"""

from __future__ import annotations

import abc


class Proposer(abc.ABC):
    """Base class of draft sources.

    Attributes:
      name: short name used in the statistics (``lookup``, ``model``, ``mtp``, ...).
      host_side: the proposer works from the host history alone (no device work or read).
      last_probs: after `propose`, the proposer's probability of each proposed token (list[float], same length as
        the proposal), or None when the source has none (prompt lookup). ``--spec_min_p`` cuts a proposal at the
        first token whose probability is below it.
    """

    name: str = "proposer"
    # True for a proposer that works from the host history alone, in microseconds, with no device work and no
    # device read (prompt lookup, scripted): the solo loop may ask it while a step is in flight, to see whether it
    # still has nothing to propose (`strata_jax.pipeline.solo`). False (MTP, draft models): asked only when its
    # answer builds the next window.
    host_side: bool = False

    def __init__(self):
        self.last_probs: list[float] | None = None

    @abc.abstractmethod
    def propose(self, history_ids: list[int], max_n: int, min_p: float = 0.0) -> list[int]:
        """Propose up to ``max_n`` tokens that follow ``history_ids``.

        Args:
          history_ids: prompt + accepted tokens; the last one is row 0 of the coming window (not yet verified into
            the target's state).
          max_n: most tokens to propose (>= 0).
          min_p: proposers that know probabilities stop at the first token with probability < min_p (0 = off).

        Returns:
          list[int] of at most ``max_n`` token ids (may be empty: then the window is a plain step).
        """

    def observe(self, kept_tokens: list[int]) -> None:
        """The tokens the last window emitted (accepted proposals + the bonus token)."""

    def reset(self) -> None:
        """Forget the sequence (a new generation starts)."""
        self.last_probs = None


class ScriptedProposer(Proposer):
    """A proposer driven by a function, for tests and experiments.

    Args:
      fn: ``fn(history_ids, max_n) -> list[int]``.
      name: statistics name.
    """

    host_side = True

    def __init__(self, fn, name: str = "scripted"):
        super().__init__()
        self.fn = fn
        self.name = name

    def propose(self, history_ids, max_n, min_p=0.0):
        self.last_probs = None
        return [int(t) for t in self.fn(list(history_ids), max_n)][:max_n]
