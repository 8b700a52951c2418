"""When to speculate: a proposer steps aside when its windows do not pay (Strata's draft policy).

The policy measures, online, the committed tokens and the wall time of each round (proposal + window + commit),
per mode (``spec``: a window with proposals; ``plain``: a one-row step) and per window size (valid rows). The value of
a mode is tokens per millisecond (EMA tokens / EMA ms). Speculation is used while its value is at least ``margin``
times the plain value; otherwise the proposer steps aside and the round is a plain step. Every ``probe_every``
rounds the losing mode is run once so that both estimates stay current. Rounds that compiled a function are not
measured. None of this changes the output: every window is verified by exact match.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class _Ema:
    tokens: float = 0.0
    seconds: float = 0.0
    n: int = 0

    def add(self, tokens: float, seconds: float, alpha: float) -> None:
        if self.n == 0:
            self.tokens, self.seconds = tokens, seconds
        else:
            self.tokens += alpha * (tokens - self.tokens)
            self.seconds += alpha * (seconds - self.seconds)
        self.n += 1

    @property
    def tok_per_ms(self) -> float:
        return self.tokens / (self.seconds * 1e3) if self.seconds > 0 else 0.0


class SpecPolicy:
    """Online choice between speculative windows and plain steps.

    Args:
      margin: speculation must reach ``margin`` x the plain tokens/ms to be used (default 1.0).
      probe_every: run the losing mode once every this many rounds (default 16).
      alpha: EMA weight of a new measurement (default 0.25).
      warmup: measured spec rounds before the first comparison (default 3).

    Attributes:
      stepped_aside: rounds in which the proposer was not asked.
    """

    def __init__(self, margin: float = 1.0, probe_every: int = 16, alpha: float = 0.25, warmup: int = 3):
        self.margin = float(margin)
        self.probe_every = max(int(probe_every), 2)
        self.alpha = float(alpha)
        self.warmup = int(warmup)
        self.modes: dict[str, _Ema] = {"spec": _Ema(), "plain": _Ema()}
        self.sizes: dict[int, _Ema] = {}
        self.rounds = 0
        self.stepped_aside = 0

    def use_proposer(self) -> bool:
        """Whether this round should ask the proposer (True) or be a plain step (False)."""
        self.rounds += 1
        s, p = self.modes["spec"], self.modes["plain"]
        if s.n < self.warmup:
            return True
        if p.n == 0:
            self.stepped_aside += 1
            return False  # measure a plain step once
        probe = self.rounds % self.probe_every == 0
        wins = s.tok_per_ms >= self.margin * p.tok_per_ms
        use = wins != probe
        if not use:
            self.stepped_aside += 1
        return use

    def record(self, mode: str, rows: int, tokens: int, seconds: float, compiled: bool = False) -> None:
        """A finished round: ``mode`` ``spec``/``plain``, ``rows`` valid rows of its window, ``tokens`` committed,
        ``seconds`` of wall time (proposal included). Rounds that compiled are ignored."""
        if compiled:
            return
        self.modes[mode].add(tokens, seconds, self.alpha)
        self.sizes.setdefault(rows, _Ema()).add(tokens, seconds, self.alpha)

    def table(self) -> dict:
        """{``"spec"``/``"plain"``/rows: {tok_per_ms, tokens, ms, n}} for the statistics."""
        out = {}
        for k, e in list(self.modes.items()) + sorted(self.sizes.items()):
            out[str(k)] = {"tok_per_ms": e.tok_per_ms, "tokens": e.tokens, "ms": e.seconds * 1e3, "n": e.n}
        return out
