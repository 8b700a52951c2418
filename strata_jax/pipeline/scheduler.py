"""Batch slots: requests, slots, admission, completion, cancellation, and the four batch modes (SERVING.md §4).

Each request decodes exactly the tokens it decodes alone (`strata_jax.pipeline.solo.generate`): a batch row's
arithmetic is the single-row window's (tests/test_windows.py), sampling draws are keyed by (seed, position), and
proposals are verified by exact match, so they only change how many tokens a window yields.

Modes (`strata_jax.pipeline.groups.resolve_groups` picks one):

* ``serial``: every active slot's token in one window [B, 1] that goes through stage 0, then stage 1, ... (the
  ``step`` kind: every valid row is kept, the commit is fused in).
* ``pipelined``: the slots are split into G groups; stage k runs group g while stage k+1 runs group g-1. The host
  loop (`BatchScheduler._tick`) issues one launch per stage per tick with `Engine.run_stage` (JAX dispatch is
  asynchronous) and reads a group's picks only right before that group's next stage-0 launch.
* ``batch_mtp``: serial windows [B, 2]: each slot's token + 1 proposal, at most 8 rows (4 slots) per window; slots
  that do not fit rotate. Keep counts come from the last stage; `Engine.commit` advances each slot on every stage.
* ``piped_mtp``: pipelined groups of one slot; each group's window [1, 1 + N] carries its token + up to N
  proposals. The keep count stays on the device (the last stage's ``n_keep``) and is handed to every stage's
  `Engine.commit_stage` right after the last stage's launch, before that group's next window, with no host round
  trip.

Admission: a request whose arrival has come is read into a free slot (`Engine.reset_slot` + `Engine.prefill`)
between windows while the other slots keep their state; pipelined modes drain first (every group finishes its window
in flight). A slot left alone (no other active slot, nothing waiting) returns to the solo path: windows [1, 1]
(or [1, 1 + P] with proposals) on its slot, and joins the batch again when a request arrives. Cancellation frees the
slot at the next window boundary; a freed slot is reused by the next admission.

Proposals come from per-request `strata_jax.proposers.Proposer` objects (``proposer_factory``): prompt lookup works
on every model; MTP when the model has it.

Sources: SERVING.md §4.1-4.6; seeds 000-004 (Strata PRs #1253, #1636, #2985 and issue #2973).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import numpy as np

from strata_jax.errors import StrataError
from strata_jax.pipeline.engine import MAX_WINDOW, Engine
from strata_jax.pipeline.groups import Resolution
from strata_jax.pipeline.solo import stop_strings
from strata_jax.sampling import SEED_MAX, RowSampling, SamplingParams
from strata_jax.state import Rows

log = logging.getLogger("strata_jax")

_DUMMY = SamplingParams(0.0)


@dataclasses.dataclass
class Request:
    """One generation request.

    Attributes:
      prompt_ids: the prompt's token ids (list[int], non-empty).
      max_new_tokens: most tokens generated (>= 1).
      sampling: sampler settings (greedy when temperature <= 0; draws keyed by (seed, position)).
      stop_ids: ids that end the generation (EOS); included in the output, as on the solo path.
      stop: called with the tokens so far after each token; True ends the generation (stop strings,
        `strata_jax.pipeline.solo.stop_strings`), checked where the solo path checks it.
      arrival: seconds after the scheduler starts before the request may be admitted.
      arrival_round: scheduler round before which it is not admitted (deterministic staggering in tests).
      cancel_round: the request is cancelled at this scheduler round (tests); None = never.
      rid: an id (default: its index in submission order).
      text: the prompt text, if any (passed through to the result).
    """

    prompt_ids: list
    max_new_tokens: int = 32
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple = ()
    stop: Callable[[list[int]], bool] | None = None
    arrival: float = 0.0
    arrival_round: int = 0
    cancel_round: int | None = None
    rid: Any = None
    text: str = ""


@dataclasses.dataclass
class RequestResult:
    """What a request produced. Times are seconds since the scheduler started.

    Attributes: rid, tokens (list[int]), stop_reason (``eos``, ``stop string``, ``max tokens``, ``context end``,
    ``cancelled`` or
    ``refused: ...``), slot, prompt_tokens, arrival_s, admitted_s, first_token_s, finished_s, windows (windows this
    request took part in, solo ones included), solo_windows, proposed, accepted.
    """

    rid: Any
    tokens: list = dataclasses.field(default_factory=list)
    stop_reason: str = ""
    slot: int = -1
    prompt_tokens: int = 0
    arrival_s: float = 0.0
    admitted_s: float = -1.0
    first_token_s: float = -1.0
    finished_s: float = -1.0
    windows: int = 0
    solo_windows: int = 0
    proposed: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Active:
    """Host-side view of a busy slot."""

    def __init__(self, req: Request, res: RequestResult, slot: int, proposer):
        self.req, self.res, self.slot, self.proposer = req, res, slot, proposer
        self.n_prompt = len(req.prompt_ids)
        self.history = list(req.prompt_ids)
        self.done = ""

    @property
    def pos(self) -> int:
        """Position of the next window's row 0 (the last emitted token)."""
        return self.n_prompt + len(self.res.tokens) - 1

    def emit(self, tok: int, max_context: int) -> str:
        """The solo path's checks, in its order (`strata_jax.pipeline.solo.generate`)."""
        self.res.tokens.append(int(tok))
        self.history.append(int(tok))
        if int(tok) in self.req.stop_ids:
            return "eos"
        if self.req.stop is not None and self.req.stop(self.res.tokens):
            return "stop string"
        if len(self.res.tokens) >= self.req.max_new_tokens:
            return "max tokens"
        if self.n_prompt + len(self.res.tokens) - 1 >= max_context - 1:
            return "context end"
        return ""

    def room(self, cap: int, max_context: int) -> int:
        return max(0, min(cap, self.req.max_new_tokens - len(self.res.tokens) - 1, max_context - 2 - self.pos))


@dataclasses.dataclass
class _Flight:
    """A group's window: where it is in the stages, and what the host needs once its last stage ran."""

    slots: list            # slot per segment (dummies included)
    active: list           # _Active or None per segment
    props: list            # proposals per segment
    toks: Any              # int32 [B, T] (device)
    rows: Rows
    samp: RowSampling
    kind: str
    next_stage: int = 0
    x: Any = None
    pendings: list = dataclasses.field(default_factory=list)
    out: Any = None


class BatchScheduler:
    """Runs requests on an engine's slots in the mode of a `Resolution` (engine-level API: `insert` a request into a
    slot (prefill), `step` one round of windows, `run` until every request is done).

    Args:
      engine: an Engine with ``n_slots`` = the resolution's slots (>= 1).
      resolution: from `resolve_groups`.
      proposer_factory: ``() -> Proposer`` per request, for the ``batch_mtp`` and ``piped_mtp`` modes (and the
        solo path in them); default prompt lookup.
      solo_return: a lone slot decodes on the solo path.
      spec_min_p: cut each slot's proposals at the first one whose proposer probability is below it (0 = off).
      clock: seconds (default ``time.perf_counter``).

    Raises:
      StrataError: the engine's slot count does not match the resolution's groups, or a pipelined mode without a
        layer split.
    """

    def __init__(self, engine: Engine, resolution: Resolution, *, proposer_factory: Callable | None = None,
                 solo_return: bool = True, spec_min_p: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.engine = engine
        self.res = resolution
        self.mode = resolution.mode
        N = engine.n_slots
        G = resolution.n_groups
        if N % G or (self.mode != "solo" and N != G * resolution.slots_per_group):
            raise StrataError(f"engine has {N} slots; the resolution wants {G} groups of {resolution.slots_per_group}")
        if self.mode in ("pipelined", "piped_mtp") and len(engine.stages) < 2:
            raise StrataError(f"{self.mode}: pipelined groups need a layer split")
        self.groups = [list(range(g * (N // G), (g + 1) * (N // G))) for g in range(G)]
        self.props_per_window = {"batch_mtp": 1, "piped_mtp": resolution.piped_mtp}.get(self.mode, 0)
        if proposer_factory is None:
            from strata_jax.proposers import LookupProposer

            proposer_factory = LookupProposer
        self.proposer_factory = proposer_factory
        self.solo_return = solo_return
        self.spec_min_p = float(spec_min_p)
        self.clock = clock
        self.t0 = None
        self.round = 0
        self.queue: list[tuple[Request, RequestResult]] = []
        self.active: dict[int, _Active] = {}     # slot -> _Active
        self.results: dict[Any, RequestResult] = {}
        self.order: list = []
        self._cancel: set = set()
        self._flights: dict[int, _Flight] = {}   # group -> its window (in flight or with unread results)
        self._rr = 0                             # rotation offset for batch_mtp windows
        self.stats = {"windows": 0, "solo_windows": 0, "admissions": 0, "drains": 0, "ticks": 0}

    # ---- requests ------------------------------------------------------------------------------------------------
    def submit(self, req: Request):
        """Queue a request; returns its id."""
        if not req.prompt_ids:
            raise StrataError("empty prompt")
        rid = req.rid if req.rid is not None else len(self.order)
        req.rid = rid
        res = RequestResult(rid, prompt_tokens=len(req.prompt_ids), arrival_s=float(req.arrival))
        self.results[rid] = res
        self.order.append(rid)
        self.queue.append((req, res))
        return rid

    def cancel(self, rid) -> None:
        """Cancel a request (queued: dropped; active: its slot is freed at the next window boundary)."""
        self._cancel.add(rid)

    def _now(self) -> float:
        return self.clock() - self.t0

    def _ready(self) -> list:
        now = self._now()
        return [(q, r) for q, r in self.queue if q.arrival_round <= self.round and q.arrival <= now]

    def _free_slot(self) -> int | None:
        best, best_n = None, None
        for g in self.groups:  # the group with the fewest busy slots (consecutive requests go to different groups)
            free = [s for s in g if s not in self.active]
            n_busy = len(g) - len(free)
            if free and (best_n is None or n_busy < best_n):
                best, best_n = free[0], n_busy
        return best

    def insert(self, req: Request, res: RequestResult, slot: int) -> None:
        """Admit: zero the slot's state, read the prompt into it, emit the first token (synchronous)."""
        res.admitted_s = self._now()
        res.slot = slot
        try:
            self.engine.reset_slot(slot)
            first, _ = self.engine.prefill(slot, list(req.prompt_ids), req.sampling)
        except StrataError as e:
            res.stop_reason = f"refused: {e}"
            res.finished_s = self._now()
            return
        a = _Active(req, res, slot, self.proposer_factory() if self.props_per_window else None)
        if a.proposer is not None:
            a.proposer.reset()
            if hasattr(a.proposer, "bind"):
                a.proposer.bind(slot)  # proposers that keep per-slot state on the device (MTP)
        res.first_token_s = self._now()
        self.stats["admissions"] += 1
        reason = a.emit(first, self.engine.max_context)
        if reason:
            self._finish(a, reason)
        else:
            self.active[slot] = a

    def _finish(self, a: _Active, reason: str) -> None:
        a.res.stop_reason = reason
        a.res.finished_s = self._now()
        self.active.pop(a.slot, None)

    def _apply_cancels(self) -> None:
        for q, r in list(self.queue):
            if q.cancel_round is not None and q.cancel_round <= self.round:
                self._cancel.add(q.rid)
        for a in list(self.active.values()):
            if a.req.cancel_round is not None and a.req.cancel_round <= self.round:
                self._cancel.add(a.req.rid)
        if not self._cancel:
            return
        for q, r in list(self.queue):
            if q.rid in self._cancel:
                self.queue.remove((q, r))
                r.stop_reason, r.finished_s = "cancelled", self._now()
        for a in list(self.active.values()):
            if a.req.rid in self._cancel:
                self._finish(a, "cancelled")
        # handled: keep only cancellations of requests not submitted yet (a finished request's is a no-op)
        self._cancel = {rid for rid in self._cancel if rid not in self.results}

    def _admit(self) -> None:
        for q, r in self._ready():
            slot = self._free_slot()
            if slot is None:
                return
            self.queue.remove((q, r))
            self.insert(q, r, slot)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def run(self, requests=()) -> list[RequestResult]:
        """Submit ``requests`` and step until every request is done; returns results in submission order."""
        for r in requests:
            self.submit(r)
        while self.queue or self.active or self._flights:
            self.step()
        return [self.results[rid] for rid in self.order]

    def step(self) -> None:
        """One round: cancellations, admissions (after a drain in pipelined modes), then one serial window, one
        pipeline tick, or one solo window."""
        if self.t0 is None:
            self.t0 = self.clock()
        piped = self.mode in ("pipelined", "piped_mtp")
        ready = bool(self._ready()) and self._free_slot() is not None
        lone = (self.solo_return and len(self.active) == 1 and not ready)
        if piped and self._flights and (ready or lone or self._cancel_due()):
            self._drain()
            return
        self._apply_cancels()
        self._admit()
        if not self.active and self._flights:
            self._drain()
            return
        if not self.active:
            if self.queue:
                nxt = min(q.arrival for q, _ in self.queue)
                if nxt > self._now() and all(q.arrival_round <= self.round for q, _ in self.queue):
                    time.sleep(min(nxt - self._now(), 0.05))
            self.round += 1
            return
        if len(self.active) == 1 and self.solo_return and not (bool(self._ready()) and self._free_slot() is not None):
            self._solo_window(next(iter(self.active.values())))
        elif self.mode in ("serial", "solo"):
            self._serial_window(0)
        elif self.mode == "batch_mtp":
            self._serial_window(1)
        else:
            self._tick()
        self.round += 1

    def _cancel_due(self) -> bool:
        """A cancellation of an active request is waiting (a pipelined mode drains before applying it)."""
        return any(a.req.rid in self._cancel or (a.req.cancel_round is not None and a.req.cancel_round <= self.round)
                   for a in self.active.values())

    # ---- serial windows and the solo path -------------------------------------------------------------------------
    def _props(self, a: _Active, cap: int) -> list[int]:
        room = a.room(cap, self.engine.max_context)
        if room <= 0 or a.proposer is None:
            return []
        props = [int(t) for t in a.proposer.propose(list(a.history), room, self.spec_min_p)][:room]
        probs = a.proposer.last_probs
        if self.spec_min_p > 0 and probs is not None:
            n_ok = 0
            while n_ok < len(props) and n_ok < len(probs) and probs[n_ok] >= self.spec_min_p:
                n_ok += 1
            props = props[:n_ok]
        return props

    def _serial_window(self, P: int) -> None:
        """All active slots (at most 8 rows: ``8 // (1 + P)`` slots, rotating) in one window through every stage."""
        eng = self.engine
        slots = sorted(self.active)
        per = MAX_WINDOW // (1 + P)
        B = min(eng.n_slots, per)
        if len(slots) > B:
            k = self._rr % len(slots)
            slots = (slots[k:] + slots[:k])[:B]
            self._rr += B
        segs = [self.active[s] for s in slots]
        free = [s for s in range(eng.n_slots) if s not in self.active]
        fl = self._build(slots + free[:B - len(slots)], segs + [None] * (B - len(slots)), P)
        res = eng.window(np.asarray(fl.toks), fl.rows, fl.samp, kind=fl.kind)
        if fl.kind == "window":
            eng.commit(fl.rows, res.pending, res.n_keep)
        self.stats["windows"] += 1
        self._emit(fl, res.picks, res.n_keep)

    def _solo_window(self, a: _Active) -> None:
        """A lone slot: a [1, 1 + P] window on its slot (P = the mode's proposals), as the solo loop runs it."""
        P = self.props_per_window
        fl = self._build([a.slot], [a], P)
        res = self.engine.window(np.asarray(fl.toks), fl.rows, fl.samp, kind=fl.kind)
        if fl.kind == "window":
            self.engine.commit(fl.rows, res.pending, res.n_keep)
        self.stats["solo_windows"] += 1
        a.res.solo_windows += 1
        self._emit(fl, res.picks, res.n_keep)

    def _build(self, slots: list, segs: list, P: int) -> _Flight:
        """The window of ``segs`` (an _Active, or None for a free slot's dummy row) with up to P proposals each."""
        B, T = len(slots), 1 + P
        toks = np.zeros((B, T), np.int32)
        pos0, nval, props, samp = [], [], [], []
        for b, (s, a) in enumerate(zip(slots, segs)):
            if a is None:
                pos0.append(0)
                nval.append(1)
                props.append([])
                samp.append(_DUMMY)
                continue
            pr = self._props(a, P) if P else []
            toks[b, 0] = a.res.tokens[-1]
            toks[b, 1:1 + len(pr)] = pr
            pos0.append(a.pos)
            nval.append(1 + len(pr))
            props.append(pr)
            samp.append(a.req.sampling)
        import jax.numpy as jnp

        return _Flight(list(slots), list(segs), props, jnp.asarray(toks), Rows.make(slots, pos0, nval),
                       RowSampling.make(samp), "window" if P else "step")

    def _emit(self, fl: _Flight, picks: np.ndarray, n_keep: np.ndarray) -> None:
        """Apply a window's picks and keep counts to its slots (the solo loop's emission rule)."""
        for b, a in enumerate(fl.active):
            if a is None or self.active.get(a.slot) is not a:
                continue  # a dummy row, or a slot cancelled while its window was in flight
            a.res.windows += 1
            pr = fl.props[b]
            nk = int(n_keep[b]) if pr else 1
            emitted = pr[:nk - 1] + [int(picks[b, nk - 1])]
            if pr:
                a.res.proposed += len(pr)
                a.res.accepted += nk - 1
            kept = []
            for t in emitted:
                kept.append(t)
                reason = a.emit(t, self.engine.max_context)
                if reason:
                    self._finish(a, reason)
                    break
            if a.proposer is not None:
                a.proposer.observe(kept)

    # ---- pipelined groups ------------------------------------------------------------------------------------------
    def _land(self, g: int) -> None:
        """Read group g's picks and keep counts (blocks on that group's last stage only) and apply them."""
        fl = self._flights.pop(g)
        picks, n_keep = np.asarray(fl.out["picks"]), np.asarray(fl.out["n_keep"])
        self._emit(fl, picks, n_keep)

    def _launch(self, g: int, fl: _Flight) -> None:
        """Launch group g's next stage (and, after the last stage of a window, the per-stage commits with the
        device-side keep counts)."""
        eng = self.engine
        k = fl.next_stage
        x = fl.toks if k == 0 else fl.x
        out, pending = eng.run_stage(k, fl.kind, x, fl.rows, fl.toks, fl.samp)
        fl.pendings.append(pending)
        fl.next_stage = k + 1
        if fl.next_stage == len(eng.stages):
            fl.out = out
            if fl.kind == "window":
                keep = out["n_keep"]  # stays on the device
                for i, pd in enumerate(fl.pendings):
                    eng.commit_stage(i, fl.rows, pd, keep)
            fl.pendings = []
            self.stats["windows"] += 1
        else:
            fl.x = out["hidden"]

    def _tick(self) -> None:
        """One pipeline tick: at most one launch per stage. In-flight groups advance first (deepest stage first,
        never waiting on the device); then one group at its window boundary reads its picks and launches stage 0."""
        S = len(self.engine.stages)
        busy = set()
        inflight = sorted(((fl.next_stage, g) for g, fl in self._flights.items() if fl.out is None), reverse=True)
        for k, g in inflight:
            if k not in busy:
                busy.add(k)
                self._launch(g, self._flights[g])
        if 0 not in busy:
            G = len(self.groups)
            for j in range(G):
                g = (self._rr + j) % G
                fl = self._flights.get(g)
                if fl is not None and fl.out is None:
                    continue
                if fl is not None:
                    self._land(g)
                segs = [self.active.get(s) for s in self.groups[g]]
                if not any(segs):
                    continue
                self._rr = g + 1
                nf = self._build(self.groups[g], segs, self.props_per_window)
                self._flights[g] = nf
                self._launch(g, nf)
                break
        self.stats["ticks"] += 1
        assert S >= 1

    def _drain(self) -> None:
        """Finish every window in flight and apply every group's results (before an admission, a cancellation or
        the solo path takes a slot)."""
        self.stats["drains"] += 1
        while any(fl.out is None for fl in self._flights.values()):
            for k, g in sorted(((fl.next_stage, g) for g, fl in self._flights.items() if fl.out is None),
                               reverse=True):
                self._launch(g, self._flights[g])
        for g in sorted(self._flights):
            self._land(g)


# ---- command line helpers (strata_jax.run_generate --batch) ---------------------------------------------------------
REQUEST_KEYS = ("prompt", "prompt_ids", "chat", "max_new_tokens", "seed", "temperature", "top_k", "top_p", "min_p",
                "arrival", "arrival_offset", "id")


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def check_request_values(values: dict, label: Callable[[str], str]) -> None:
    """The rules one request's settings must follow, shared by the solo flags (``label = lambda k: "--" + k``) and
    the lines of ``--prompts_file`` (``label = lambda k: repr(k)``): types and ranges of ``temperature`` (finite),
    ``top_k`` (0..64), ``top_p`` ((0, 1]), ``min_p`` ([0, 1]), ``seed`` (0..2**32-1), ``max_new_tokens`` (>= 1),
    ``arrival`` (finite, >= 0), ``prompt`` (non-empty text), ``prompt_ids`` (non-empty list of ids >= 0; the
    vocabulary bound is `check_prompt_ids_vocab`), ``chat`` (bool), ``id`` (a string or a number).

    Raises:
      StrataError: the first value that breaks a rule, named with ``label(key)``.
    """
    import math

    for key, v in values.items():
        name = label(key)
        if key in ("temperature", "top_p", "min_p", "arrival", "arrival_offset"):
            if not _is_num(v):
                raise StrataError(f"{name} {v!r}: must be a number")
            if not math.isfinite(float(v)):
                raise StrataError(f"{name} {v}: must be a finite number" + (" (<= 0 is greedy)"
                                                                            if key == "temperature" else ""))
            if key == "top_p" and not 0.0 < v <= 1.0:
                raise StrataError(f"{name} {v}: must lie in (0, 1]")
            if key == "min_p" and not 0.0 <= v <= 1.0:
                raise StrataError(f"{name} {v}: must lie in [0, 1]")
            if key in ("arrival", "arrival_offset") and v < 0:
                raise StrataError(f"{name} {v}: must be >= 0 (seconds after the start)")
        elif key in ("top_k", "seed", "max_new_tokens"):
            if not _is_int(v):
                raise StrataError(f"{name} {v!r}: must be an integer")
            if key == "top_k" and not 0 <= v <= 64:
                raise StrataError(f"{name} {v}: must lie in 0..64 (0 = 64)")
            if key == "seed" and not 0 <= v <= SEED_MAX:
                raise StrataError(f"{name} {v}: must lie in 0..{SEED_MAX} (2**32 - 1)")
            if key == "max_new_tokens" and v < 1:
                raise StrataError(f"{name} {v}: must be >= 1")
        elif key == "prompt":
            if not isinstance(v, str):
                raise StrataError(f"{name} {v!r}: must be a string")
            if not v:
                raise StrataError(f"{name} is empty")
        elif key == "prompt_ids":
            if not isinstance(v, (list, tuple)) or not all(_is_int(t) for t in v):
                raise StrataError(f"{name} {v!r}: must be a list of integer token ids")
            if not v:
                raise StrataError(f"{name} is empty")
            bad = [int(t) for t in v if t < 0]
            if bad:
                raise StrataError(f"{name}: token ids must be >= 0 (got {bad[:3]})")
        elif key == "chat":
            if not isinstance(v, bool):
                raise StrataError(f"{name} {v!r}: must be true or false")
        elif key == "id":
            if not (isinstance(v, str) or (_is_num(v) and math.isfinite(float(v)))):
                raise StrataError(f"{name} {v!r}: must be a string or a number")
        else:
            raise StrataError(f"unknown key {name} (known: {', '.join(REQUEST_KEYS)})")


def check_prompt_ids_vocab(ids, vocab_size: int, name: str) -> None:
    """Raises StrataError when a token id lies outside the model's vocabulary 0..vocab_size-1."""
    bad = [int(t) for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise StrataError(f"{name}: token ids must lie in 0..{vocab_size - 1} (got {bad[:3]})")


def usable_tokenizer(engine: Engine):
    """``(tokenizer, None)``, or ``(None, reason)`` when the model's tokenizer cannot be built (no tokenizer in the
    file, or one the tokenizer library refuses)."""
    try:
        return engine.tokenizer, None
    except StrataError as e:
        return None, str(e)
    except Exception as e:  # the tokenizers library's own errors (e.g. "Error while initializing BPE")
        return None, f"cannot build it: {type(e).__name__}: {e}"


@dataclasses.dataclass
class PromptLine:
    """One validated line of ``--prompts_file`` (before tokenization): ``where`` is ``path:line``, ``rid`` the
    request's id, ``d`` the JSON object."""

    where: str
    rid: Any
    d: dict


def read_prompts_file(path: str) -> list[PromptLine]:
    """Read and check ``--prompts_file`` without a model: every line a JSON object with known keys, values of the
    right type and range (`check_request_values`, the solo flags' rules), one of ``prompt`` / ``prompt_ids``, unique
    scalar ids (a line without ``id`` gets its index among the requests).

    Raises:
      StrataError: unreadable or non-UTF-8 file, or a bad line, named as ``--prompts_file PATH:LINE``.
    """
    import json

    try:
        with open(path, encoding="utf-8-sig") as f:  # a leading byte-order mark is not part of line 1
            # JSON Lines ends lines with "\n" (or "\r\n") only: U+2028, U+0085, ... are legal inside a JSON string
            lines = [ln[:-1] if ln.endswith("\r") else ln for ln in f.read().split("\n")]
    except OSError as e:
        raise StrataError(f"--prompts_file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise StrataError(f"--prompts_file {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    out: list[PromptLine] = []
    seen: dict = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            d = json.loads(line)
        except ValueError:
            d = None
        if not isinstance(d, dict):
            raise StrataError(f"--prompts_file {where}: not a JSON object")
        try:
            check_request_values(d, repr)
            if "prompt" in d and "prompt_ids" in d:
                raise StrataError("give one of 'prompt', 'prompt_ids', not both")
            if "prompt" not in d and "prompt_ids" not in d:
                raise StrataError("needs 'prompt' or 'prompt_ids'")
            if "prompt_ids" in d and d.get("chat"):
                raise StrataError("'chat' needs text: it cannot be combined with 'prompt_ids'")
            if "arrival" in d and "arrival_offset" in d:
                raise StrataError("give one of 'arrival', 'arrival_offset', not both")
        except StrataError as e:
            raise StrataError(f"--prompts_file {where}: {e}") from None
        rid = d.get("id", len(out))
        if rid in seen:
            raise StrataError(f"--prompts_file {where}: duplicate id {rid!r} (already used on line {seen[rid]}; "
                              f"a line without 'id' gets its request index)")
        seen[rid] = n
        out.append(PromptLine(where, rid, d))
    if not out:
        raise StrataError(f"--prompts_file {path}: no requests")
    return out


def build_requests(lines: list[PromptLine], tokenizer, *, default_max_new: int, default_sampling: SamplingParams,
                   default_chat: bool = False, system: str | None = None, stop_ids=(), vocab_size: int | None = None,
                   max_context: int | None = None, no_tokenizer_reason: str | None = None,
                   stop=None) -> list[Request]:
    """The `Request` of each checked line (`read_prompts_file`): text prompts tokenized (``chat``, default
    ``default_chat``, wraps them in the chat template with ``system``), ids checked against ``vocab_size``, every
    prompt checked against ``max_context``; missing keys take the defaults; ``stop`` (a `Request.stop` callback)
    applies to every request.

    Raises:
      StrataError: the first bad request, named as ``--prompts_file PATH:LINE`` and its id.
    """
    reqs = []
    for pl in lines:
        d = pl.d
        try:
            if "prompt_ids" in d:
                ids, text = [int(t) for t in d["prompt_ids"]], ""
                if vocab_size is not None:
                    check_prompt_ids_vocab(ids, vocab_size, "'prompt_ids'")
            else:
                if tokenizer is None:
                    raise StrataError(f"this model has no usable tokenizer ({no_tokenizer_reason or 'none'}): "
                                      f"give 'prompt_ids'")
                text = d["prompt"]
                if d.get("chat", default_chat):
                    msgs = ([{"role": "system", "content": system}] if system else []) + [
                        {"role": "user", "content": text}]
                    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
                ids = list(tokenizer.encode(text))
                if not ids:
                    raise StrataError("'prompt' gives no tokens")
            if max_context is not None and len(ids) >= max_context:
                raise StrataError(f"prompt of {len(ids)} tokens does not fit in --max_context {max_context} (it "
                                  f"needs at least {len(ids) + 1}: the prompt and one generated token)")
        except StrataError as e:
            raise StrataError(f"--prompts_file {pl.where}: request {pl.rid!r}: {e}") from None
        ds = default_sampling
        samp = SamplingParams(float(d.get("temperature", ds.temperature)), int(d.get("top_k", ds.top_k)),
                              float(d.get("top_p", ds.top_p)), float(d.get("min_p", ds.min_p)),
                              int(d.get("seed", ds.seed)))
        reqs.append(Request(ids, int(d.get("max_new_tokens", default_max_new)), samp, tuple(stop_ids), stop,
                            float(d.get("arrival", d.get("arrival_offset", 0.0))), rid=pl.rid, text=text))
    return reqs


def write_jsonl(path: str, results: list[RequestResult], tokenizer=None) -> None:
    """One JSON object per request: id, tokens, text (when a tokenizer is given), stop reason, slot, timings."""
    import json

    with open(path, "w", encoding="utf-8") as f:
        for r in results:
            d = r.as_dict()
            if tokenizer is not None:
                try:
                    d["text"] = tokenizer.decode(r.tokens, skip_special=True)
                except Exception:
                    d["text"] = None
            f.write(json.dumps(d) + "\n")


def proposer_factory_for(engine: Engine, draft: str, n_props: int = 1, draft_model: str | None = None,
                         cache_dir=None):
    """``() -> Proposer`` for batch proposals (up to ``n_props`` per window): ``--draft lookup`` / ``mtp`` / ``model``
    as asked; ``none`` picks MTP when the model has an MTP layer, else prompt lookup. Returns (factory, name).

    Raises:
      StrataError: ``--draft mtp`` on a model without an MTP layer; ``model`` without ``--draft_model``.
    """
    from strata_jax.proposers import LookupProposer, make_proposer

    n_props = max(1, int(n_props))
    if draft == "none":
        draft = "mtp" if int(getattr(engine.cfg, "n_nextn", 0) or 0) > 0 else "lookup"
    if draft == "lookup":
        return LookupProposer, "lookup"
    if draft == "mtp":
        make_proposer("mtp", engine, spec=n_props + 1)  # loads the MTP layer once; raises when the model has none
        return (lambda: make_proposer("mtp", engine, spec=n_props + 1)), "mtp"
    if draft == "model":
        shared = make_proposer("model", engine, draft_model=draft_model, spec=n_props + 1, cache_dir=cache_dir)
        if shared.engine.n_slots != engine.n_slots:
            shared.engine.set_slots(engine.n_slots)  # request in target slot s drafts in draft slot s
        return shared.fork, "model"
    raise StrataError(f"--draft {draft}: expected one of none, lookup, mtp, model")


def run_batch_cli(engine: Engine, FLAGS, lines: list[PromptLine] | None = None) -> int:
    """The ``--prompts_file`` branch of ``strata-generate``: the requests (``lines`` from `read_prompts_file`, read
    here when None) tokenized and checked against the context, memory report and fit check, group resolution (one
    log line), the requests through `BatchScheduler`, one ``[id] text`` line per request, a summary line,
    ``--out_jsonl`` and ``--stats_json``.

    The summary's rate follows the solo stats line's rule: scheduler steps during which something compiled are left
    out of both the token count and the time (their count and seconds are reported; ``--stats_json`` has both
    rates), and so is the time spent waiting for an ``arrival`` while no request is active.

    Raises:
      StrataError: no --prompts_file, a bad request, a prompt longer than --max_context, a batch that does not fit,
        impossible group flags.
    """
    import json
    import sys

    from strata_jax.pipeline.groups import resolve_groups

    if not FLAGS.prompts_file:
        raise StrataError(f"--batch {FLAGS.batch} needs --prompts_file (JSONL, one request per line)")
    if lines is None:
        lines = read_prompts_file(FLAGS.prompts_file)
    tok, why = usable_tokenizer(engine)
    if FLAGS.stop and tok is None:
        raise StrataError(f"--stop needs the model's tokenizer, and this model has no usable one ({why})")
    if tok is not None:
        eos = tuple(tok.eos_ids)
    else:
        eos = (engine.cfg.eos_id,) if engine.cfg.eos_id >= 0 else ()
    reqs = build_requests(lines, tok, default_max_new=FLAGS.max_new_tokens,
                          default_sampling=SamplingParams(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.min_p,
                                                          FLAGS.seed),
                          default_chat=bool(FLAGS.chat), system=FLAGS.system, stop_ids=eos,
                          vocab_size=engine.cfg.vocab_size, max_context=engine.max_context, no_tokenizer_reason=why,
                          stop=stop_strings(tok, FLAGS.stop) if tok is not None else None)
    for line in engine.memory_lines():
        print(line, file=sys.stderr)
    limit = int(FLAGS.memory_limit_gib * 2 ** 30) if FLAGS.memory_limit_gib else None
    engine.check_batch_fits(FLAGS.batch, limit)
    res = resolve_groups(FLAGS.batch, len(engine.stages), FLAGS.batch_groups,
                         FLAGS["batch_groups"].present > 0, FLAGS.batch_mtp, FLAGS.piped_mtp)
    if engine.n_slots != FLAGS.batch:
        engine.set_slots(FLAGS.batch)
    factory, pname = proposer_factory_for(engine, FLAGS.draft, max(res.piped_mtp, 1), FLAGS.draft_model,
                                          FLAGS.cache_dir)
    extra = f"; proposals: {pname}" if res.mode in ("batch_mtp", "piped_mtp") else ""
    print(f"batch: {res.message}{extra}", file=sys.stderr)
    sch = BatchScheduler(engine, res, proposer_factory=factory, spec_min_p=FLAGS.spec_min_p)
    # BatchScheduler.run, step by step, to leave the steps that compiled out of the rate
    caches = [engine.cache]
    d_eng = getattr(getattr(factory, "__self__", None), "engine", None)  # --draft model: the draft engine compiles too
    if d_eng is not None and d_eng is not engine:
        caches.append(d_eng.cache)

    def n_compiles() -> int:
        return sum(c.compiles for c in caches)

    def n_tokens() -> int:
        return sum(len(r.tokens) for r in sch.results.values())

    compile_s0 = engine.cache.compile_seconds
    for r in reqs:
        sch.submit(r)
    compiled_steps, compiled_s, compiled_tok, idle_s = 0, 0.0, 0, 0.0
    t0 = time.perf_counter()
    while sch.queue or sch.active or sch._flights:
        c0, k0, ts = n_compiles(), n_tokens(), time.perf_counter()
        was_idle = not sch.active and not sch._flights
        sch.step()
        if n_compiles() != c0:
            compiled_steps += 1
            compiled_s += time.perf_counter() - ts
            compiled_tok += n_tokens() - k0
        elif was_idle and n_tokens() == k0 and not sch.active and not sch._flights:  # waiting for an arrival
            idle_s += time.perf_counter() - ts
    dt = time.perf_counter() - t0
    results = [sch.results[rid] for rid in sch.order]
    for r in results:
        text = tok.decode(r.tokens, skip_special=True) if tok is not None else " ".join(map(str, r.tokens))
        print(f"[{r.rid}] {text}")
    sys.stdout.flush()
    n = sum(len(r.tokens) for r in results)
    prop, acc = sum(r.proposed for r in results), sum(r.accepted for r in results)
    n_run, t_run = n - compiled_tok, dt - compiled_s - idle_s
    rate = f"{n_run / t_run:.1f} tok/s" if n_run > 0 and t_run > 0 else "n/a tok/s"
    idle = f", nor {idle_s:.1f} s waiting for arrivals" if idle_s >= 0.05 else ""
    print(f"[batch {FLAGS.batch} {res.mode} | {len(results)} requests, {n} tokens in {dt:.2f} s | {rate} without the "
          f"{compiled_steps} step{'' if compiled_steps == 1 else 's'} that compiled ({compiled_tok} tok, {compiled_s:.1f} s)"
          f"{idle} | "
          f"windows {sch.stats['windows']} solo {sch.stats['solo_windows']} | proposals {acc}/{prop} | "
          f"compiles {engine.cache.compiles} ({engine.cache.compile_seconds:.1f} s)]", file=sys.stderr)
    if FLAGS.out_jsonl:
        write_jsonl(FLAGS.out_jsonl, results, tok)
    if FLAGS.stats_json:
        d = {"mode": res.mode, "batch": FLAGS.batch, "requests": len(results), "tokens": n, "seconds": dt,
             "tok_s": n_run / t_run if n_run > 0 and t_run > 0 else None,
             "tok_s_with_compiles": n / dt if dt > 0 else None,
             "idle_seconds": idle_s,
             "rate_rule": "tok_s leaves out the scheduler steps during which something compiled (their tokens and "
                          "their time) and the time spent waiting for arrivals with no request active "
                          "(idle_seconds); tok_s_with_compiles counts everything",
             "compiled_steps": compiled_steps, "compiled_step_tokens": compiled_tok,
             "compiled_step_seconds": compiled_s, **{k: v for k, v in sch.stats.items()},
             "proposed": prop, "accepted": acc, "model": str(FLAGS.model),
             "load_seconds": engine.load_seconds, "compiles": engine.cache.compiles,
             "compile_seconds": engine.cache.compile_seconds,
             "compile_seconds_during_run": engine.cache.compile_seconds - compile_s0,
             "per_request": [{k: v for k, v in r.as_dict().items() if k != "tokens"} | {"generated": len(r.tokens)}
                             for r in results]}
        with open(FLAGS.stats_json, "w") as f:
            json.dump(d, f, indent=1)
    return 0
