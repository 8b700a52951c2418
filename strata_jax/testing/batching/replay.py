"""Replayed acceptance for the batching benchmark (``experiments/bench_batching.py``): proposals whose acceptance is
set, not earned, so that batch arms can be timed on random weights.

A first pass decodes every prompt once without proposals (exact: every batch mode gives the solo tokens) and keeps
the tokens as the reference (`ReplayBook`). `ReplayProposer` offers, at output position j, the reference tokens
after j; the first rejected one (and those after it) is replaced by (reference + 1) % vocab, which the target's
exact-match verify rejects. How many are offered and accepted comes from `Acceptance`: a fixed rate ("synthetic
acceptance") or a profile recorded from real weights (`profile_from_positions` over what prompt lookup and a draft
model offer and have accepted at every position: `lookup_positions`, `draft_positions`; "replayed acceptance").
Draws are keyed by (request, position, k) (numpy's SeedSequence), so every arm and repetition sees the same draws.
The output never changes: the target verifies every proposal.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from strata_jax.proposers.base import Proposer

MAX_PROPOSALS = 7  # a window holds the slot's token + at most 7 proposals
DEFAULT_RATES = {"prose": 0.62, "code": 0.88, "edit": 0.97}  # Strata issue #2973's MTP acceptance per workload


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """How replayed proposals are offered and accepted.

    Either ``rate`` (a fixed rate: every window offers as many proposals as it has room for, and proposal k is
    accepted with probability ``rate`` given that proposals 1..k-1 were; with one proposal per window
    accepted / offered = rate), or a recorded profile: ``offered_at_least[k-1]`` = P(at least k proposals offered
    at a position) and ``accept_given[k-1]`` = P(proposal k accepted | proposals 1..k-1 accepted, k offered).

    Attributes:
      label: ``synthetic acceptance`` or ``replayed acceptance`` (printed in every table).
      seed: mixed into every draw.
    """

    rate: float | None = None
    offered_at_least: tuple = ()
    accept_given: tuple = ()
    label: str = "synthetic acceptance"
    seed: int = 7

    @classmethod
    def fixed(cls, rate: float, label: str = "synthetic acceptance") -> "Acceptance":
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"acceptance rate {rate} outside 0..1")
        return cls(rate=float(rate), label=label)

    @classmethod
    def from_profile(cls, prof: dict, label: str = "replayed acceptance") -> "Acceptance":
        return cls(offered_at_least=tuple(float(x) for x in prof["offered_at_least"]),
                   accept_given=tuple(float(x) for x in prof["accept_given"]), label=label)

    def decide(self, key: int, j: int, room: int) -> tuple[int, int]:
        """(offered, accepted) at output position ``j`` of request ``key`` with room for ``room`` proposals.

        The draws are ``default_rng([seed, key, j]).random(1 + room)``: u[0] picks the offered count, u[k] decides
        proposal k; the same (key, j) gives the same first draws whatever the room, so arms with different window
        caps see consistent acceptance."""
        if room <= 0:
            return 0, 0
        u = np.random.default_rng([self.seed, int(key) & 0xFFFFFFFF, int(j)]).random(1 + room)
        if self.rate is not None:
            offered, given = room, [self.rate] * room
        else:
            offered = sum(1 for q in self.offered_at_least[:room] if u[0] < q)
            given = list(self.accept_given[:room]) + [0.0] * room
        acc = 0
        while acc < offered and u[1 + acc] < given[acc]:
            acc += 1
        return offered, acc


def profile_from_positions(offered: list[int], accepted: list[int], max_k: int = MAX_PROPOSALS,
                           rooms: list[int] | None = None) -> dict:
    """A per-position acceptance profile from what a proposer offered / had accepted at every output position.

    Args:
      offered: o_j, proposals offered at position j (with room for ``max_k``).
      accepted: a_j <= o_j, the accepted prefix length at position j.
      rooms: the room at each position (near the end of a reference it is below ``max_k``); P(o >= k) counts only
        positions with room >= k, so the end of a recording does not pass for a proposer that offers less.

    Returns:
      {"offered_at_least": [P(o >= k)], "accept_given": [P(a >= k | o >= k, a >= k-1)], "positions": n,
       "offered": total, "accepted": total, "acceptance": accepted / offered, "mean_accepted": mean a_j} with lists of
      length ``max_k`` (k = 1..max_k; an empty condition gives 0).
    """
    o = np.asarray(offered, np.int64)
    a = np.asarray(accepted, np.int64)
    if o.shape != a.shape or np.any(a > o) or np.any(a < 0):
        raise ValueError("offered/accepted: same length, 0 <= accepted <= offered")
    n = len(o)
    r = np.full(n, max_k, np.int64) if rooms is None else np.asarray(rooms, np.int64)
    at_least, given = [], []
    for k in range(1, max_k + 1):
        at_least.append(float(np.mean(o[r >= k] >= k)) if np.any(r >= k) else 0.0)
        den = np.sum((o >= k) & (a >= k - 1))
        given.append(float(np.sum((o >= k) & (a >= k)) / den) if den else 0.0)
    return {"offered_at_least": at_least, "accept_given": given, "positions": int(n), "offered": int(o.sum()),
            "accepted": int(a.sum()), "acceptance": float(a.sum() / o.sum()) if o.sum() else 0.0,
            "mean_accepted": float(a.mean()) if n else 0.0}


class ReplayBook:
    """Each request's reference continuation, found by its prompt (a proposer factory gets no request id).

    Args:
      vocab: the target's vocabulary size (a rejected proposal is (reference + 1) % vocab).
    """

    def __init__(self, vocab: int):
        self.vocab = int(vocab)
        self.entries: list[tuple[tuple, int, list]] = []  # (prompt, key, reference tokens)

    def add(self, prompt_ids, reference: list[int], name: str) -> None:
        """Register ``prompt_ids`` -> ``reference`` (the tokens plain decoding emits after it); ``name`` keys the
        acceptance draws (e.g. ``"edit/2"``)."""
        self.entries.append((tuple(int(t) for t in prompt_ids), zlib.crc32(name.encode()), list(reference)))

    def find(self, history) -> tuple[int, int, list] | None:
        """(prompt length, key, reference) of the longest registered prompt that starts ``history``; None if none."""
        best = None
        for prompt, key, ref in self.entries:
            n = len(prompt)
            if n < len(history) and (best is None or n > best[0]) and tuple(history[:n]) == prompt:
                best = (n, key, ref)
        return best


class ReplayProposer(Proposer):
    """Offers the reference continuation with a given acceptance (`Acceptance`); see the module doc.

    Args:
      book: the references (`ReplayBook`).
      acceptance: `Acceptance`.
      name: statistics name.
      cost: a real proposer run beside the replay (its proposals discarded) so that its cost is in the timing, e.g.
        the draft model on random weights; None for none.
      mtp_engine: an engine whose MTP chain runs; once `bind` gave the slot, that slot's drafts are read each window
        (the device read the real `MtpProposer` makes) and discarded.

    Attributes:
      offered, accepted_planned: proposals offered / planned to be accepted (the target's verify decides).
      diverged: windows in which the history had left the reference (0 unless exactness broke).
      mtp_reads: MTP drafts read from the device (0 when no chain runs or no slot was bound).
    """

    def __init__(self, book: ReplayBook, acceptance: Acceptance, name: str = "replay", cost=None, mtp_engine=None):
        super().__init__()
        self.book, self.acceptance, self.name = book, acceptance, name
        self.cost, self.mtp_engine = cost, mtp_engine
        self.slot = None
        self.offered = self.accepted_planned = self.diverged = self.mtp_reads = 0
        self._entry = None

    def reset(self) -> None:
        super().reset()
        self._entry = None
        if self.cost is not None:
            self.cost.reset()

    def bind(self, slot: int) -> None:
        """The request's slot (the batch scheduler and the solo loop call this where they have the hook)."""
        self.slot = int(slot)
        if self.cost is not None and hasattr(self.cost, "bind"):
            self.cost.bind(slot)

    def observe(self, kept_tokens) -> None:
        if self.cost is not None:
            self.cost.observe(kept_tokens)

    def propose(self, history_ids, max_n, min_p=0.0):
        """Up to ``max_n`` reference tokens after the history, the first rejected one and those after it altered."""
        self.last_probs = None
        h = list(history_ids)
        if self.cost is not None:
            self.cost.propose(h, max_n)  # timing only
        eng = self.mtp_engine
        if eng is not None and self.slot is not None and eng.mtp.layer is not None:
            eng.mtp.proposal(self.slot)  # the device read MtpProposer makes; the drafts are not used
            self.mtp_reads += 1
        if self._entry is None:
            self._entry = self.book.find(h)
        if self._entry is None or max_n <= 0:
            return []
        n_prompt, key, ref = self._entry
        j = len(h) - n_prompt - 1  # output index of the window's row 0
        if not 0 <= j < len(ref) or h[-1] != ref[j]:
            self.diverged += 1
            return []
        room = min(int(max_n), len(ref) - 1 - j)
        o, a = self.acceptance.decide(key, j, room)
        props = list(ref[j + 1:j + 1 + o])
        for i in range(a, o):
            props[i] = (props[i] + 1) % self.book.vocab
        self.offered += o
        self.accepted_planned += a
        return props


def lookup_positions(prompt: list[int], ref: list[int], max_k: int = MAX_PROPOSALS) -> tuple[list, list]:
    """Prompt lookup at every output position j of a reference decode: (offered o_j, accepted prefix a_j) with room
    for ``max_k`` proposals (lookup proposes what it would in the real run: the history is the same)."""
    from strata_jax.proposers import LookupProposer

    lp = LookupProposer()
    hist = list(prompt)
    off, acc = [], []
    for j in range(len(ref) - 1):
        hist.append(ref[j])
        room = min(max_k, len(ref) - 1 - j)
        props = lp.propose(hist, room)
        a = 0
        while a < len(props) and props[a] == ref[j + 1 + a]:
            a += 1
        off.append(len(props))
        acc.append(a)
    return off, acc


def draft_positions(picks_after: np.ndarray, prompt_len: int, ref: list[int],
                    max_k: int = MAX_PROPOSALS) -> tuple[list, list]:
    """Greedy draft-model proposals at every output position j, from the draft's teacher-forced picks over
    prompt + reference (``picks_after[i]`` = its greedy pick after position i). A greedy chain that matches the
    reference for k tokens is exactly the teacher-forced picks at j, j+1, ..., so a_j = the run of positions from j
    where the pick equals the next reference token; the draft always offers its room."""
    ok = [int(picks_after[prompt_len + j]) == ref[j + 1] for j in range(len(ref) - 1)]
    off, acc = [], []
    run = 0
    runs = [0] * len(ok)
    for j in range(len(ok) - 1, -1, -1):
        run = run + 1 if ok[j] else 0
        runs[j] = run
    for j in range(len(ok)):
        room = min(max_k, len(ref) - 1 - j)
        off.append(room)
        acc.append(min(runs[j], room))
    return off, acc
