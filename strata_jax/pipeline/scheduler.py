"""Batch slots: requests, slots, admission, completion, cancellation, and the batch modes.

Each request decodes exactly the tokens it decodes alone (`strata_jax.pipeline.solo.generate`): a batch row's
arithmetic is the single-row window's (tests/test_windows.py), sampling draws are keyed by (seed, position), and
proposals are verified by exact match, so they only change how many tokens a window yields. Every request moves
forward through its `strata_jax.pipeline.sequence.Sequence`, the object the solo loop uses too: one emit / stop /
proposal-trimming rule for both paths.

`BatchScheduler` is synchronous (`submit`, `step`, `run`); `strata_jax.pipeline.loop.EngineLoop` runs it in its own
thread for callers that submit from other threads (the HTTP server). A step follows vLLM v1's shape where it keeps
things simple: the window is planned as data (`WindowPlan`: which slots, which rows, which proposals), executed
(`Engine.window` + `Engine.commit`, or one pipeline tick), then its picks and keep counts update the sequences.

Modes (`strata_jax.pipeline.groups.resolve_groups` picks one):

* ``solo``: one slot; every window is a solo window (below).
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

Overlap (the host loop keeps up): a serial or solo window is launched in one `step` and read in the next, after
the following window has been launched; the host streams a window's tokens and checks its stop strings
(`Sequence.flush`) while the device computes the next one. Plain steps over an unchanged set of slots are chained:
the next step's tokens are the in-flight step's picks, still on the device. A request that ends in a window (EOS, a
stop string) may have a row in the window launched after it: that row is dropped when it is read, and the state it
wrote past the request's end is reset by the slot's next admission (`Engine.start_prefill` zeroes the slot first).

Admission: a request whose arrival has come takes a free slot (submission order) and its prompt is read into it
(`Engine.start_prefill`: the slot zeroed, then one `strata_jax.pipeline.engine.PromptRead` chunk at a time) while
the other slots keep their state; pipelined modes drain first (every group finishes its window in flight, whose
dummy rows may sit on the free slot). A long prompt does not stall the decoding slots: each step reads at most
``prefill_chunks`` chunks, oldest admission first, then runs the decoding slots' window (or pipeline tick), so they
keep streaming while it is read; several slots may be admitting at once, each waiting its turn. The read's share
of the device time beside decoding slots is capped (``read_share``): after a step's chunks, the decoding slots'
windows run (as programs of several steps where their row count has one) until their time has earned the chunks'
(a 512-row chunk of the 48-layer Qwen3.8-Flash-Next file takes ~145 ms on an H100, ~20 one-row steps; with a chunk
before every window the decoding slot kept 5.5 of its 136.5 tok/s, 2026-12-07). The chunks are the
ones `Engine.prefill` reads in one go (same shapes, same order), and no window touches an admitting slot (its rows
are left out, so a window beside an admission may be narrower than ``--batch``), so the slot ends its read in the
one-go state and every token is still the solo token. While nobody decodes, chunks are read without pause. A slot
left alone (no other active slot, nothing waiting) returns to the solo path: windows [1, 1 + P] on its slot with
P = ``solo_spec - 1`` proposals (or the mode's own P when ``solo_spec`` is 0), a one-row step when there is no
proposal, and joins the batch again when a request's read is done. Cancellation frees the slot at the next window
boundary (an admitting one between two chunks); a freed slot is reused by the next admission.

Faults: an exception in one request's host code (its proposer, its stop or streaming callback) or in its prefill
ends that request (stop reason ``error: ...``); an exception in a window ends the requests of that window; when
the engine's state was lost with it, every active request ends and the slots are re-created. The scheduler goes on.

Proposals come from per-request `strata_jax.proposers.Proposer` objects (``proposer_factory``): prompt lookup works
on every model; MTP when the model has it.

Sources: Strata PRs #1253, #1636, #2985 and issue #2973 (batch MTP, slot groups on a layer split).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.errors import StrataError
from strata_jax.pipeline.engine import Engine, check_decode_steps
from strata_jax.pipeline.groups import Resolution
from strata_jax.pipeline.sequence import Sequence
from strata_jax.pipeline.stages import MAX_WINDOW
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows

log = logging.getLogger("strata_jax")

_DUMMY = SamplingParams(0.0)
# The default cap on prompt reads' share of the device time beside decoding slots (issue 14: a decoding slot keeps
# >= 50% of its rate while a long prompt is read beside it).
READ_SHARE = 0.5


@dataclasses.dataclass
class Request:
    """One generation request.

    Attributes:
      prompt_ids: the prompt's token ids (list[int], non-empty).
      max_new_tokens: most tokens generated (>= 1).
      sampling: sampler settings (greedy when temperature <= 0; draws keyed by (seed, position)).
      stop_ids: ids that end the generation (EOS); included in the output, as on the solo path.
      stop: called with the tokens so far after each token; True ends the generation (stop strings,
        `strata_jax.pipeline.sequence.stop_strings`), checked where the solo path checks it.
      arrival: seconds after the scheduler starts before the request may be admitted.
      arrival_round: scheduler round before which it is not admitted (deterministic staggering in tests).
      cancel_round: the request is cancelled at this scheduler round (tests); None = never.
      rid: an id (default: its index in submission order).
      text: the prompt text, if any (passed through to the result).
      on_token: called with each streamed token id (EOS is not streamed), from the thread that steps the scheduler.
      on_finish: called with the `RequestResult` once the request has ended (any stop reason), same thread.
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
    on_token: Callable[[int], None] | None = None
    on_finish: Callable[["RequestResult"], None] | None = None


@dataclasses.dataclass
class RequestResult:
    """What a request produced. Times are seconds since the scheduler started.

    Attributes: rid, tokens (list[int]), stop_reason (``eos``, ``stop string``, ``max tokens``, ``context end``,
    ``cancelled``, ``refused: ...`` (the prompt could not be read: too long for the context, ...) or ``error: ...``
    (an exception in this request's prefill, proposer, callbacks or window)), slot, prompt_tokens, arrival_s,
    admitted_s (its slot taken, the read begins), first_token_s (its prompt read, the first token picked),
    finished_s, windows (windows this request took part in, solo ones included), solo_windows, proposed, accepted,
    prefill_chunks (chunks its prompt was read in). `ttft_s` is the time to first token.
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
    prefill_chunks: int = 0

    @property
    def ttft_s(self) -> float | None:
        """Seconds from arrival (the later of ``arrival`` and the submission) to the first token; None before it."""
        return self.first_token_s - self.arrival_s if self.first_token_s >= 0 else None

    def as_dict(self) -> dict:
        """The fields as a JSON-ready dict, the request's id under ``id`` (the prompts file's and the server's
        name for it), plus ``ttft_s``."""
        d = dataclasses.asdict(self)
        return {"id": d.pop("rid"), **d, "ttft_s": self.ttft_s}


@dataclasses.dataclass
class _Active:
    """A busy slot: its request, result and sequence (``seq.tokens`` is ``res.tokens``)."""

    req: Request
    res: RequestResult
    slot: int
    seq: Sequence
    policy: Any = None   # SpecPolicy of the solo windows, or None


@dataclasses.dataclass
class _Admission:
    """A slot taken for a request whose prompt is being read: ``read`` is its `strata_jax.pipeline.engine.PromptRead`."""

    req: Request
    res: RequestResult
    slot: int
    read: Any


@dataclasses.dataclass
class WindowPlan:
    """One window, planned before it runs: the segments (one slot each), their rows and proposals.

    Attributes:
      slots: slot per segment (free slots' dummy rows included).
      active: the `_Active` per segment, None for a dummy row.
      props: proposals per segment (list[int]).
      toks: int32 [B, T] the window's tokens (row 0: each slot's last token, then its proposals).
      rows: the `Rows` layout; samp: per-segment sampler settings.
      kind: ``window`` (kept rows decided by the last stage, committed after) or ``step`` (every row kept).
      n_steps: a ``step`` run as ``n_steps`` steps in one device program (`Engine.run_steps`): each segment emits up
        to ``n_steps`` tokens.
      solo: a solo window (a lone slot on the solo path).
      next_stage, x, pendings, out, toks_d: a pipelined group's progress through the stages (``toks_d``: ``toks``
        on the device; for a chained serial step, the previous step's picks, which replace ``toks``); ``out``: the
        last stage's outputs once launched.
      t_launch, compiles0: clock time and compile count at the first launch (window latency, compiled or not).
      seconds, compiled: set when its results are read: its share of the wall time (from its launch, or from the
        previous window's read if later) and whether something compiled since its launch.
    """

    slots: list
    active: list
    props: list
    toks: np.ndarray
    rows: Rows
    samp: RowSampling
    kind: str
    solo: bool = False
    next_stage: int = 0
    x: Any = None
    pendings: list = dataclasses.field(default_factory=list)
    out: Any = None
    t_launch: float = 0.0
    compiles0: int = 0
    toks_d: Any = None
    seconds: float = 0.0
    compiled: bool = False
    n_steps: int = 1  # a ``step`` plan run as this many steps in one device program (`Engine.run_steps`)


@dataclasses.dataclass
class WindowRecord:
    """What one finished window did, for statistics and metrics (``on_window``).

    Attributes: mode (``solo`` for solo windows, else the scheduler's mode), segments (active requests in it),
    rows (valid rows), proposed, accepted, tokens (tokens emitted), seconds (its share of the wall time: from its
    first launch, or from the previous window's results read if later, to its results read), compiled (something
    compiled between its launch and its read).
    """

    mode: str
    segments: int
    rows: int
    proposed: int
    accepted: int
    tokens: int
    seconds: float
    compiled: bool


class BatchScheduler:
    """Runs requests on an engine's slots in the mode of a `Resolution` (`submit` requests, `step` one round,
    `run` until every request is done; `cancel` at any time between steps).

    Args:
      engine: an Engine with ``n_slots`` = the resolution's slots (>= 1).
      resolution: from `resolve_groups`.
      proposer_factory: ``() -> Proposer`` per request, for the ``batch_mtp`` and ``piped_mtp`` modes and for
        solo windows with ``solo_spec``; default prompt lookup.
      solo_return: a lone slot decodes on the solo path.
      spec_min_p: cut each slot's proposals at the first one whose proposer probability is below it (0 = off).
      solo_spec: window cap T (2..8) of solo windows (the solo path's ``--spec``: up to T - 1 proposals); 0 = the
        mode's own proposals per window (none in ``solo``, ``serial`` and ``pipelined``).
      spec_policy: solo windows ask each request's `strata_jax.proposers.SpecPolicy` whether proposing pays (the
        solo path's policy; never changes the output).
      on_window: called with a `WindowRecord` after every window (statistics, metrics).
      prefill_chunks: prompt chunks (``engine.prefill_chunk`` rows each) read between two windows of the decoding
        slots while a prompt is read beside them, oldest admission first (>= 0; 0 = every waiting prompt whole before
        the next window: the decoding slots wait).
      read_share: while slots decode, the largest fraction of the device time prompt reads take (0 < share <= 1):
        after a step's chunks (up to ``prefill_chunks``) of c seconds the windows run until they have taken
        ``c * (1 - share) / share`` seconds (a step during which something compiled earns nothing; a chunk that
        compiled costs nothing), so the decoding slots keep about ``1 - share`` of their rate or more; the debt is
        the reads', paid back by any later windows, never saved up in advance; 1 = the chunks as
        ``prefill_chunks`` allows, before every window (the read ends soonest).
      clock: seconds (default ``time.perf_counter``).
      decode_steps: plain steps of serial / solo windows run as this many steps per device program
        (`Engine.run_steps`; 1 where `steps_unavailable`) while no request waits for a slot or is being read (or
        the read waits for its ``read_share`` longer than the program takes, at a row count `step_program_rows`
        has), no slot has proposals and every slot's budget holds them; the tokens are those of one step per
        window.

    Attributes (besides the arguments): queue, active (slot -> busy slot), admitting (slot -> `_Admission`: its
    prompt being read), results, order; stats: counts of ``windows``, ``solo_windows``, ``admissions``, ``drains``,
    ``ticks``, ``errors``, ``prefill_chunks``, ``step_programs`` (plain steps run as ``decode_steps`` steps in one
    program), and the decode beside prompt reads (`decode_beside_prefill`):
    ``beside_prefill_steps`` (steps while a prompt was being read and slots decoded, nothing compiled: with or
    without a chunk of the read), their ``beside_prefill_tokens`` (tokens of the slots decoding when the step began)
    and ``beside_prefill_seconds`` (the whole step: chunks and window), and ``beside_prefill_compiled_steps`` (such
    steps during which something compiled, left out of the three).

    Raises:
      StrataError: the engine's slot count does not match the resolution's groups, a pipelined mode without a
        layer split, ``solo_spec`` outside 0 and 2..8, a negative ``prefill_chunks``, or ``read_share`` outside
        (0, 1].
    """

    def __init__(self, engine: Engine, resolution: Resolution, *, proposer_factory: Callable | None = None,
                 solo_return: bool = True, spec_min_p: float = 0.0, solo_spec: int = 0, spec_policy: bool = False,
                 on_window: Callable[[WindowRecord], None] | None = None, prefill_chunks: int = 1,
                 read_share: float = READ_SHARE, clock: Callable[[], float] = time.perf_counter,
                 decode_steps: int = 1):
        self.engine = engine
        self.res = resolution
        self.mode = resolution.mode
        N = engine.n_slots
        G = resolution.n_groups
        if N % G or (self.mode != "solo" and N != G * resolution.slots_per_group):
            raise StrataError(f"engine has {N} slots; the resolution wants {G} groups of {resolution.slots_per_group}")
        if self.mode in ("pipelined", "piped_mtp") and len(engine.stages) < 2:
            raise StrataError(f"{self.mode}: pipelined groups need a layer split")
        solo_spec = int(solo_spec)
        if solo_spec and not 2 <= solo_spec <= MAX_WINDOW:
            raise StrataError(f"--spec {solo_spec}: the window cap must lie in 2..{MAX_WINDOW}")
        if int(prefill_chunks) < 0:
            raise StrataError(f"--batch_prefill_chunks {prefill_chunks}: must be >= 0 (0 = each prompt whole)")
        self.prefill_chunks = int(prefill_chunks)
        if not 0.0 < float(read_share) <= 1.0:
            raise StrataError(f"--batch_read_share {read_share}: must lie in (0, 1] (1 = chunks before every window)")
        self.read_share = float(read_share)
        self._read_credit = 0.0   # seconds of chunks the windows beside a read have earned (< 0: windows first)
        self._step_seconds = 0.0   # the latest uncompiled plain step's time per step (0: none yet)
        self.groups = [list(range(g * (N // G), (g + 1) * (N // G))) for g in range(G)]
        self.props_per_window = {"batch_mtp": 1, "piped_mtp": resolution.piped_mtp}.get(self.mode, 0)
        self.solo_props = solo_spec - 1 if solo_spec else self.props_per_window
        self.decode_steps = 1 if self.steps_unavailable else check_decode_steps(decode_steps)
        if proposer_factory is None:
            from strata_jax.proposers import LookupProposer

            proposer_factory = LookupProposer
        self.proposer_factory = proposer_factory
        self.solo_return = solo_return
        self.spec_min_p = float(spec_min_p)
        self.spec_policy = bool(spec_policy)
        self.on_window = on_window
        self.clock = clock
        self.t0 = None
        self.round = 0
        self.queue: list[tuple[Request, RequestResult]] = []
        self.active: dict[int, _Active] = {}     # slot -> _Active
        self.admitting: dict[int, _Admission] = {}  # slot -> its prompt read (admission order: FIFO)
        self.results: dict[Any, RequestResult] = {}
        self.order: list = []
        self._cancel: set = set()
        self._flights: dict[int, WindowPlan] = {}   # group -> its window (in flight or with unread results)
        self._pending: WindowPlan | None = None       # the serial / solo window launched, read at the next step
        self._last_read = 0.0                         # clock when the last window's results were read
        self._rr = 0                             # rotation offset for batch_mtp windows
        # chained: serial / solo steps launched from the picks of the step in flight, before its read
        self.stats = {"windows": 0, "solo_windows": 0, "admissions": 0, "drains": 0, "ticks": 0, "errors": 0,
                      "chained": 0, "step_programs": 0, "prefill_chunks": 0, "beside_prefill_steps": 0,
                      "beside_prefill_tokens": 0, "beside_prefill_seconds": 0.0, "beside_prefill_compiled_steps": 0}

    @property
    def steps_unavailable(self) -> str:
        """Why no plain step here runs as several per program, in words ('' when they may): the engine's reason
        (`Engine.steps_unavailable`), pipelined groups, or proposals for every request."""
        why = self.engine.steps_unavailable
        if why:
            return why
        if self.mode in ("pipelined", "piped_mtp"):
            return "pipelined slot groups run one step per window"
        if self.props_per_window or self.solo_props:
            return ("--batch_mtp" if self.mode == "batch_mtp" else "--draft") + " decodes in verify windows"
        return ""

    @property
    def step_program_rows(self) -> list[int]:
        """The row counts B of the programs of ``decode_steps`` steps this scheduler runs (`Engine.run_steps`,
        ascending; none with ``decode_steps`` 1): 1 for a lone request on the solo path (``solo_return``), and the
        serial window's rows, ``min(n_slots, MAX_WINDOW)``: a plain step runs as such a program while no slot is
        being read (`_steps_for`), and then the window has a row on every slot up to `MAX_WINDOW` (dummy rows on
        the idle ones, `_plan_serial`), or while a read waits for its share (its slot has no row) when the window's
        rows are one of these counts; a chained step keeps its predecessor's rows."""
        if self.decode_steps <= 1:
            return []
        return sorted({min(self.engine.n_slots, MAX_WINDOW)} | ({1} if self.solo_return else set()))

    def compile_steps_ahead(self, sampling: SamplingParams = _DUMMY) -> list:
        """Start compiling the programs of `step_program_rows` in background threads (`Engine.compile_steps_ahead`,
        `CompileCache.ahead`), for rows of ``sampling``'s kind (greedy or not: two programs; dummy rows are
        greedy), so that they compile beside what the caller runs next instead of each at its first call
        (strata-serve's warm-up: on a GPU a cold compile of a large model's program takes about a minute). The
        first program of several steps with B rows then runs the compiled one. Call it from the thread that
        steps the scheduler, or while that thread is idle (nothing submitted: it reads the engine's state).
        Returns the compile cache keys started (none where built or started already)."""
        eng = self.engine
        started = []
        for B in self.step_program_rows:
            if eng.compile_steps_ahead(list(range(B)), RowSampling.make([sampling] * B), self.decode_steps):
                started.append(eng.steps_key(B, self.decode_steps))
        return started

    # ---- requests ------------------------------------------------------------------------------------------------
    def submit(self, req: Request):
        """Queue a request; returns its id.

        Raises:
          StrataError: an empty prompt, or an id already in use.
        """
        if not req.prompt_ids:
            raise StrataError("empty prompt")
        rid = req.rid if req.rid is not None else len(self.order)
        if rid in self.results:
            raise StrataError(f"request id {rid!r} is already in use")
        req.rid = rid
        now = self._now() if self.t0 is not None else 0.0
        res = RequestResult(rid, prompt_tokens=len(req.prompt_ids), arrival_s=max(float(req.arrival), now))
        self.results[rid] = res
        self.order.append(rid)
        self.queue.append((req, res))
        return rid

    def cancel(self, rid) -> None:
        """Cancel a request (queued: dropped; admitting or active: its slot is freed at the next window boundary)."""
        self._cancel.add(rid)

    def pop_result(self, rid) -> RequestResult | None:
        """Forget a finished request (a long-running caller keeps memory bounded); returns its result."""
        res = self.results.get(rid)
        if res is None or not res.stop_reason:
            return None
        del self.results[rid]
        self.order.remove(rid)
        return res

    @property
    def busy(self) -> bool:
        """Requests are queued, being read or decoding, or windows are in flight."""
        return bool(self.queue or self.admitting or self.active or self.in_flight)

    @property
    def in_flight(self) -> bool:
        """Windows are launched whose results are not read yet (pipelined groups, or the serial / solo window
        read at the next `step`)."""
        return bool(self._flights) or self._pending is not None

    def decode_beside_prefill(self) -> float | None:
        """Tokens per second of the decoding slots over the steps while a prompt was being read (with or without a
        chunk of it: chunks and windows timed together; steps that compiled left out), None when there was no such
        step: what a long prompt read costs the streams beside it (before 2026-12-07's ``read_share`` only the
        steps that read a chunk counted, each step read one)."""
        st = self.stats
        if not st["beside_prefill_steps"] or st["beside_prefill_seconds"] <= 0:
            return None
        return st["beside_prefill_tokens"] / st["beside_prefill_seconds"]

    def next_arrival(self) -> tuple[Any, float] | None:
        """(rid, seconds from now) of the queued request that arrives first, when it has not arrived yet; else
        None (also before the first step: the clock starts there). Seconds only: ``arrival_round`` and
        ``cancel_round`` (tests) are not looked at."""
        if self.t0 is None:
            return None
        waiting = [q for q, _ in self.queue if q.arrival > self._now()]
        if not waiting:
            return None
        q = min(waiting, key=lambda r: r.arrival)
        return q.rid, q.arrival - self._now()

    def _now(self) -> float:
        return self.clock() - self.t0

    def _ready(self) -> list:
        now = self._now()
        return [(q, r) for q, r in self.queue if q.arrival_round <= self.round and q.arrival <= now]

    def _admission_ready(self) -> bool:
        return bool(self._ready()) and self._free_slot() is not None

    def _free_slot(self) -> int | None:
        best, best_n = None, None
        for g in self.groups:  # the group with the fewest busy slots (consecutive requests go to different groups)
            free = [s for s in g if s not in self.active and s not in self.admitting]
            n_busy = len(g) - len(free)
            if free and (best_n is None or n_busy < best_n):
                best, best_n = free[0], n_busy
        return best

    def _close(self, req: Request, res: RequestResult, reason: str) -> None:
        """End a request: its stop reason, its finish time, its ``on_finish`` callback."""
        res.stop_reason = reason
        res.finished_s = self._now()
        if req.on_finish is not None:
            try:
                req.on_finish(res)
            except Exception:
                log.exception("on_finish of request %r raised", req.rid)

    def _finish(self, a: _Active, reason: str) -> None:
        self.active.pop(a.slot, None)
        self._close(a.req, a.res, reason)

    def _fail(self, a: _Active, e: BaseException) -> None:
        """End one request on an exception in its own code path (the others go on)."""
        log.error("request %r failed: %s: %s", a.req.rid, type(e).__name__, e, exc_info=e)
        self.stats["errors"] += 1
        self._finish(a, f"error: {type(e).__name__}: {e}")

    def _start(self, req: Request, res: RequestResult, slot: int) -> _Admission | None:
        """Admit into ``slot``: zero it and begin the prompt's read (`Engine.start_prefill`); None when the request
        ended here (refused: its prompt does not fit; or an error)."""
        res.admitted_s = self._now()
        res.slot = slot
        try:
            return _Admission(req, res, slot, self.engine.start_prefill(slot, list(req.prompt_ids), req.sampling))
        except StrataError as e:
            self._close(req, res, f"refused: {e}")
        except Exception as e:
            self._prefill_failed(req, res, e)
        return None

    def _prefill_failed(self, req: Request, res: RequestResult, e: BaseException) -> None:
        log.error("prefill of request %r failed: %s: %s", req.rid, type(e).__name__, e, exc_info=e)
        self.stats["errors"] += 1
        self._close(req, res, f"error: {type(e).__name__}: {e}")
        self._recover()

    def _read_prompts(self) -> int:
        """Read the admitting slots' prompts, oldest admission first: while any slot decodes (its window comes
        next), at most ``prefill_chunks`` chunks and none before the windows have earned the last ones' time
        (``read_share``); every chunk while none decodes (nobody waits). A finished read makes its slot active with
        its first token (`_activate`). Returns the seconds of the chunks charged to the read's share (those read
        while slots decode, nothing compiling)."""
        n = counted = 0
        charged = 0.0
        while self.admitting:
            if self.active and self.prefill_chunks and counted >= self.prefill_chunks:
                break
            if not counted and self._read_waits():   # the step's chunks wait for the windows, then go together
                break
            adm = next(iter(self.admitting.values()))
            if self.active and not counted and self._pending is not None and self._pending.out is not None:
                # the window in flight finishes first: its time is the windows', not the chunk's
                jax.block_until_ready(self._pending.out)
            counted += bool(self.active)
            t, c0 = self.clock(), self._compiles()
            try:
                done = adm.read.step()
            except Exception as e:
                self.admitting.pop(adm.slot, None)
                self._prefill_failed(adm.req, adm.res, e)
                continue
            if self.active and self._compiles() == c0:   # a chunk that compiled costs the windows nothing
                dt = self.clock() - t
                self._read_credit -= dt
                charged += dt
            n += 1
            adm.res.prefill_chunks += 1
            if done:
                self.admitting.pop(adm.slot, None)
                self._activate(adm.req, adm.res, adm.slot, adm.read.pick)
        self.stats["prefill_chunks"] += n
        return charged

    def _activate(self, req: Request, res: RequestResult, slot: int, first: int) -> None:
        """The prompt is read: the slot becomes active and emits its first token (``first``)."""
        a = _Active(req, res, slot, Sequence(req.prompt_ids, max_new_tokens=req.max_new_tokens,
                                             max_context=self.engine.max_context, eos_ids=req.stop_ids,
                                             stop=req.stop, on_token=req.on_token, spec_min_p=self.spec_min_p,
                                             tokens=res.tokens))
        self.active[slot] = a
        res.first_token_s = self._now()
        self.stats["admissions"] += 1
        try:
            if self.props_per_window or self.solo_props:
                a.seq.proposer = self.proposer_factory()
                a.seq.proposer.reset()
                if hasattr(a.seq.proposer, "bind"):
                    a.seq.proposer.bind(slot)  # proposers that keep per-slot state on the device (MTP)
                if self.spec_policy and self.solo_props:
                    from strata_jax.proposers import SpecPolicy

                    a.policy = SpecPolicy()
            reason = a.seq.emit(first)
        except Exception as e:
            self._fail(a, e)
            return
        if reason:
            self._finish(a, reason)

    def _apply_cancels(self) -> None:
        for q, r in list(self.queue):
            if q.cancel_round is not None and q.cancel_round <= self.round:
                self._cancel.add(q.rid)
        for a in [*self.active.values(), *self.admitting.values()]:
            if a.req.cancel_round is not None and a.req.cancel_round <= self.round:
                self._cancel.add(a.req.rid)
        if not self._cancel:
            return
        for q, r in list(self.queue):
            if q.rid in self._cancel:
                self.queue.remove((q, r))
                self._close(q, r, "cancelled")
        for adm in list(self.admitting.values()):
            if adm.req.rid in self._cancel:  # between two chunks: the half-read slot is free (zeroed at its next use)
                self.admitting.pop(adm.slot)
                self._close(adm.req, adm.res, "cancelled")
        for a in list(self.active.values()):
            if a.req.rid in self._cancel:
                self._finish(a, "cancelled")
        # handled: keep only cancellations of requests not submitted yet (a finished request's is a no-op)
        self._cancel = {rid for rid in self._cancel if rid not in self.results}

    def _admit(self) -> None:
        """Each ready request, in submission order, takes a free slot and begins its read (`_start`)."""
        for q, r in self._ready():
            slot = self._free_slot()
            if slot is None:
                return
            adm = self._start(q, r, slot)
            if adm is not None:
                self.admitting[slot] = adm  # before leaving the queue: another thread never sees it nowhere
            self.queue.remove((q, r))

    # ---- the loop ------------------------------------------------------------------------------------------------
    def run(self, requests=()) -> list[RequestResult]:
        """Submit ``requests`` and step until every request is done; returns results in submission order."""
        for r in requests:
            self.submit(r)
        while self.busy:
            self.step()
        return [self.results[rid] for rid in self.order]

    def step(self) -> None:
        """One round: cancellations, admissions (after a drain in pipelined modes), prompt chunks
        (`_read_prompts`), then one serial window, one pipeline tick, or one solo window (`_decode`).

        Serial and solo windows overlap the host's work with the device's: a round launches its window and leaves
        it in flight; the next round launches the following window first, then reads the one in flight and streams
        its tokens (`_serial_round`)."""
        if self.t0 is None:
            self.t0 = self.clock()
        piped = self.mode in ("pipelined", "piped_mtp")
        lone = self.solo_return and len(self.active) == 1 and not self._admission_ready()
        if piped and self._flights and (self._admission_ready() or lone or self._cancel_due()):
            self._drain()
            return
        n_active, n_admitted = len(self.active), self.stats["admissions"]
        self._apply_cancels()
        self._admit()
        t, c0 = self.clock(), self._compiles()
        decoding = [(a, len(a.res.tokens)) for a in self.active.values()]
        reading = bool(self.admitting)
        chunk_seconds = self._read_prompts()
        # a slot joined (its read done) or left: the next step cannot be chained from the picks in flight
        changed = len(self.active) != n_active or self.stats["admissions"] != n_admitted
        self._decode(changed)
        if not decoding:
            return
        if self._compiles() != c0:
            self.stats["beside_prefill_compiled_steps"] += reading
            return
        dt = self.clock() - t
        if reading:
            self.stats["beside_prefill_steps"] += 1
            self.stats["beside_prefill_tokens"] += sum(len(a.res.tokens) - k for a, k in decoding)
            self.stats["beside_prefill_seconds"] += dt
        if self.read_share < 1.0:
            # the windows' time (the step's less its chunks') pays back the reads' debt, whichever read made it
            # (back-to-back short prompts are not each free), and no credit is saved up beyond 0
            earned = (dt - chunk_seconds) * self.read_share / (1.0 - self.read_share)
            self._read_credit = min(0.0, self._read_credit + earned)

    def _decode(self, changed: bool) -> None:
        """The window part of a step: one serial window, one pipeline tick or one solo window of the active slots
        (``changed``: the set of active slots changed in this step, so no chaining from the picks in flight)."""
        if not self.active and (self._flights or self._pending is not None):
            self._drain()
            return
        if not self.active:
            if self.queue and not self.admitting:
                nxt = min(q.arrival for q, _ in self.queue)
                if nxt > self._now() and all(q.arrival_round <= self.round for q, _ in self.queue):
                    time.sleep(min(nxt - self._now(), 0.05))
            self.round += 1
            return
        lone = len(self.active) == 1 and self.solo_return and not self._admission_ready()
        if lone or self.mode in ("serial", "solo", "batch_mtp"):
            self._serial_round(lone, chain_ok=not changed)
        else:
            self._settle()
            if self.active:
                self._tick()
        self.round += 1

    def _next_plan(self, lone: bool) -> WindowPlan:
        """The serial or solo window of the active slots now (their pushed tokens)."""
        if lone:
            return self._plan_solo(next(iter(self.active.values())))
        return self._plan_serial(1 if self.mode == "batch_mtp" else 0)

    def _serial_round(self, lone: bool, chain_ok: bool) -> None:
        """One serial or solo round, overlapped: launch the next window, then read the window in flight.

        When the window in flight is a plain step over exactly the slots that would decode now (no admission,
        cancellation or finish since, the same solo / serial choice, no proposals in the mode), the next window is
        launched before the read, its tokens the in-flight window's picks still on the device (`_chain`). Otherwise
        the window in flight is read and its tokens pushed (EOS, max tokens, context end), the next window is
        planned from them and launched, and only then are the read tokens streamed and checked against the stop
        strings (`Sequence.flush`). A request that a stop string ends there has a row in the window just launched:
        that row is dropped when the window is read (its slot's state past the end is reset by the slot's next
        admission)."""
        prev, self._pending = self._pending, None
        nxt = self._chain(prev, lone) if (chain_ok and prev is not None) else None
        pushed = self._read(prev) if prev is not None else None
        if nxt is None and self.active:
            lone = len(self.active) == 1 and self.solo_return and not self._admission_ready()
            nxt = self._next_plan(lone)
            self._launch_serial(nxt)
        if prev is not None and pushed is not None:
            self._flush_results(prev, pushed)
        if nxt is not None and nxt.out is not None and any(a is not None and self.active.get(a.slot) is a
                                                           for a in nxt.active):
            self._pending = nxt  # else every request of it ended in the flush: dropped unread

    def _settle(self) -> None:
        """Read the serial / solo window in flight, if any, and apply its results (before a pipeline tick, a drain);
        a window none of whose requests is active any more (all cancelled) is dropped unread, without waiting."""
        prev, self._pending = self._pending, None
        if prev is not None and any(a is not None and self.active.get(a.slot) is a for a in prev.active):
            pushed = self._read(prev)
            if pushed is not None:
                self._flush_results(prev, pushed)

    def _chain(self, prev: WindowPlan, lone: bool) -> WindowPlan | None:
        """The window after ``prev`` launched from ``prev``'s picks on the device, or None when it cannot be (see
        `_serial_round`): ``prev`` is a plain step (one row per slot) whose live requests are exactly the active
        ones, on the layout the next plan would have: none of its slots is being read (a prompt read that began
        after ``prev`` was planned, on a slot of its dummy rows: a row there would write into the half-read state)
        and it has the next plan's rows (not the narrower window of a read since cancelled or failed). A row whose
        request ends in ``prev`` for certain (no budget left for a second token) is a dummy row."""
        if prev.kind != "step" or prev.out is None or prev.solo != lone:
            return None
        live = [a for a in prev.active if a is not None]
        if any(self.active.get(a.slot) is not a for a in live) or len(live) != len(self.active):
            return None
        if lone:
            if self.solo_props:
                return None
        elif self.mode == "batch_mtp" or len(self.active) > min(self.engine.n_slots, MAX_WINDOW):
            return None
        elif len(prev.slots) != self._serial_rows() or any(s in self.admitting for s in prev.slots):
            return None
        segs, pos0, samp = [], [], []
        prev_pos = np.asarray(prev.rows.pos0)
        for b, a in enumerate(prev.active):
            if a is not None and a.seq.budget < prev.n_steps + 1:
                a = None  # its last token is in prev
            segs.append(a)
            pos0.append(int(prev_pos[b]) + prev.n_steps if a is not None else 0)
            samp.append(a.req.sampling if a is not None else _DUMMY)
        if not any(a is not None for a in segs):
            return None
        B = len(prev.slots)
        plan = WindowPlan(list(prev.slots), segs, [[] for _ in range(B)], np.zeros((B, 1), np.int32),
                          Rows.make(prev.slots, pos0, [1] * B), RowSampling.make(samp), "step", solo=prev.solo)
        plan.n_steps = self._steps_for(segs, ahead=prev.n_steps)
        # the in-flight step's last picks feed the rows (a dummy row's token is moot)
        plan.toks_d = prev.out["last"] if prev.n_steps > 1 else prev.out["picks"]
        self._launch_serial(plan)
        if plan.out is None:
            return None
        self.stats["chained"] += 1
        return plan

    def _steps_for(self, segs: list, ahead: int = 0) -> int:
        """Steps per device program for a plain step of ``segs`` (`decode_steps`, else 1): only while no arrived
        request waits for a slot, no prompt is being read (its next chunk would wait for the whole program) unless
        the read waits anyway for the windows to earn its next chunk (``read_share``) and the window's rows are a
        count `step_program_rows` has, no cancellation is due, no live segment has a proposer, and every live
        segment's budget, ``ahead`` tokens from now, holds them."""
        n = self.decode_steps
        # (decode_steps is 1 where `steps_unavailable`: pipelined groups); requests not arrived yet do not wait
        if n <= 1 or self._ready() or self._cancel_due():
            return 1
        if self.admitting:
            if not (self._read_waits() and len(segs) in self.step_program_rows):
                return 1
            # only a program the read would wait for anyway: the windows still owe the reads more than the
            # program and the one in flight take
            owed = -self._read_credit * (1.0 - self.read_share) / self.read_share
            if not 0.0 < self._step_seconds * (n + 1) <= owed:
                return 1
        live = [a for a in segs if a is not None]
        if any(a.seq.proposer is not None or a.seq.budget - ahead < n for a in live):
            return 1
        return n

    def _read_waits(self) -> bool:
        """A prompt read beside decoding slots waits for their windows to earn its next chunk (``read_share``)."""
        return bool(self.active and self.prefill_chunks and self.read_share < 1.0 and self._read_credit < 0.0)

    def _cancel_due(self) -> bool:
        """A cancellation of an active request is waiting (a pipelined mode drains before applying it)."""
        return any(a.req.rid in self._cancel or (a.req.cancel_round is not None and a.req.cancel_round <= self.round)
                   for a in self.active.values())

    # ---- planning: which slots, which rows, which proposals ---------------------------------------------------------
    def _plan_serial(self, P: int) -> WindowPlan:
        """All active slots (at most 8 rows: ``8 // (1 + P)`` slots, rotating) in one window through every stage,
        padded with dummy rows on idle slots (not on admitting ones, so the window may have fewer rows)."""
        slots = sorted(self.active)
        # dummy rows go to idle slots only: one on an admitting slot would write into its half-read state
        free = [s for s in range(self.engine.n_slots) if s not in self.active and s not in self.admitting]
        B = self._serial_rows(P)   # len(slots) + len(free), at most MAX_WINDOW // (1 + P)
        if len(slots) > B:
            k = self._rr % len(slots)
            slots = (slots[k:] + slots[:k])[:B]
            self._rr += B
        segs = [self.active[s] for s in slots]
        return self._plan(slots + free[:B - len(slots)], segs + [None] * (B - len(slots)), P)

    def _serial_rows(self, P: int = 0) -> int:
        """Rows of the serial window `_plan_serial` plans now with P proposals per slot: one per slot not being
        read (active, or idle with a dummy row), at most ``MAX_WINDOW // (1 + P)``."""
        return min(self.engine.n_slots - len(self.admitting), MAX_WINDOW // (1 + P))

    def _plan_solo(self, a: _Active) -> WindowPlan:
        """A lone slot on the solo path: [1, 1 + P] with its proposals, or a one-row step when it has none (the
        solo loop's shapes). ``a.policy`` may step the proposer aside."""
        P = self.solo_props
        if P and a.policy is not None and a.seq.room(P) > 0 and not a.policy.use_proposer():
            P = 0
        plan = self._plan([a.slot], [a], P)
        if plan.active[0] is not None and not plan.props[0] and plan.kind == "window":
            plan = self._plan([a.slot], [a], 0)  # nothing proposed: a plain step
        plan.solo = True
        return plan

    def _plan(self, slots: list, segs: list, P: int) -> WindowPlan:
        """The window of ``segs`` (an _Active, or None for a free slot's dummy row) with up to P proposals each. A
        request whose proposer raises ends here and its row becomes a dummy."""
        B, T = len(slots), 1 + P
        toks = np.zeros((B, T), np.int32)
        pos0, nval, props, samp = [], [], [], []
        segs = list(segs)
        for b, a in enumerate(segs):
            pr = []
            if a is not None and P:
                try:
                    pr = a.seq.propose(P)
                except Exception as e:
                    self._fail(a, e)
                    segs[b] = a = None
            if a is None:
                pos0.append(0)
                nval.append(1)
                props.append([])
                samp.append(_DUMMY)
                continue
            toks[b, 0] = a.seq.last
            toks[b, 1:1 + len(pr)] = pr
            pos0.append(a.seq.pos)
            nval.append(1 + len(pr))
            props.append(pr)
            samp.append(a.req.sampling)
        plan = WindowPlan(list(slots), segs, props, toks, Rows.make(slots, pos0, nval), RowSampling.make(samp),
                          "window" if P else "step")
        if not P:
            plan.n_steps = self._steps_for(segs)
        return plan

    # ---- execution and update --------------------------------------------------------------------------------------
    def _compiles(self) -> int:
        return self.engine.cache.compiles

    def _launch_serial(self, plan: WindowPlan) -> None:
        """Launch a serial or solo window (every stage, then for a ``window`` the commit with the keep counts left
        on the device) without waiting for it; ``plan.out`` holds the last stage's outputs (None when it failed or
        every request of the plan failed while it was planned)."""
        eng = self.engine
        plan.t_launch, plan.compiles0 = self.clock(), self._compiles()
        if not any(a is not None for a in plan.active):
            return
        try:
            toks = plan.toks_d if plan.toks_d is not None else plan.toks
            if plan.n_steps > 1:
                out = dict(eng.run_steps(toks, plan.rows, plan.samp, plan.n_steps))
                out["n_keep"] = np.ones((len(plan.slots),), np.int32)
                self.stats["step_programs"] += 1
            else:
                out, pendings = eng.run(plan.kind, toks, plan.rows, plan.samp)
            if plan.kind == "window":
                eng.commit(plan.rows, pendings, out["n_keep"])
        except Exception as e:
            self._window_failed(plan, e)
            return
        plan.out = out
        self.stats["solo_windows" if plan.solo else "windows"] += 1

    def _read(self, plan: WindowPlan) -> list | None:
        """Read a launched serial / solo window's picks and keep counts (waits for it) and push them
        (`_push_results`); None when it failed."""
        if plan.out is None:
            return None
        try:
            picks, n_keep = jax.device_get((plan.out["picks"], plan.out["n_keep"]))
        except Exception as e:
            self._window_failed(plan, e)
            return None
        return self._push_results(plan, np.asarray(picks), np.asarray(n_keep))

    def _update(self, plan: WindowPlan, picks: np.ndarray, n_keep: np.ndarray) -> None:
        """Apply a window's picks and keep counts to its sequences (`Sequence.accept`: the solo loop's rule)."""
        self._flush_results(plan, self._push_results(plan, picks, n_keep))

    def _push_results(self, plan: WindowPlan, picks: np.ndarray, n_keep: np.ndarray) -> list:
        """The push phase of a window's results (`Sequence.push_window`): returns [(b, active, proposals, keep
        count, tokens before)] of the requests it updated. A request that a push ends (EOS, max tokens, context
        end) leaves ``self.active`` now (its slot is not planned again) and is finished in `_flush_results`."""
        now = self.clock()
        plan.seconds = now - max(plan.t_launch, self._last_read)  # its share of the wall time
        self._last_read = now
        plan.compiled = self._compiles() != plan.compiles0
        if plan.kind == "step" and not plan.compiled:
            self._step_seconds = plan.seconds / plan.n_steps   # what a gated read's windows cost (`_steps_for`)
        out = []
        for b, a in enumerate(plan.active):
            if a is None or self.active.get(a.slot) is not a:
                continue  # a dummy row, or a slot cancelled / ended while its window was in flight
            pr = plan.props[b]
            nk = int(n_keep[b]) if pr else 1
            n0 = len(a.seq.tokens)
            try:
                a.seq.push_window(pr, picks[b], nk)
                for j in range(1, plan.n_steps):  # the later steps of a program of several
                    if a.seq.reason:
                        break
                    a.seq.push_window([], picks[b, j:j + 1], 1)
            except Exception as e:
                self._fail(a, e)
                continue
            if a.seq.reason:
                self.active.pop(a.slot, None)
            out.append((b, a, pr, nk, n0))
        return out

    def _flush_results(self, plan: WindowPlan, pushed: list) -> None:
        """The flush phase: stream each request's pushed tokens and check its stop strings (`Sequence.flush`), count
        the window in the statistics, finish the requests that ended."""
        n_seg = n_rows = n_prop = n_acc = n_tok = 0
        for b, a, pr, nk, n0 in pushed:
            a.res.windows += 1
            a.res.solo_windows += int(plan.solo)
            a.res.proposed += len(pr)
            a.res.accepted += nk - 1
            n_seg, n_prop, n_acc = n_seg + 1, n_prop + len(pr), n_acc + nk - 1
            n_rows += plan.n_steps + len(pr)
            try:
                a.seq.flush()
            except Exception as e:
                self._fail(a, e)
                continue
            kept = len(a.seq.tokens) - n0
            n_tok += kept
            if a.policy is not None and plan.solo:
                a.policy.record("spec" if pr else "plain", 1 + len(pr), kept, plan.seconds, compiled=plan.compiled)
            if a.seq.reason:
                self._finish(a, a.seq.reason)
        if self.on_window is not None:
            self.on_window(WindowRecord("solo" if plan.solo else self.mode, n_seg, n_rows, n_prop, n_acc, n_tok,
                                        plan.seconds, plan.compiled))

    def _window_failed(self, plan: WindowPlan, e: BaseException) -> None:
        """A window raised: its requests end with the error; the engine is checked (and repaired) for the others."""
        log.error("window of slots %s failed: %s: %s", plan.slots, type(e).__name__, e, exc_info=e)
        for a in plan.active:
            if a is not None and self.active.get(a.slot) is a:
                self.stats["errors"] += 1
                self._finish(a, f"error: {type(e).__name__}: {e}")
        self._recover()

    def _recover(self) -> None:
        """After an exception in the engine: when a state buffer was lost (donated to a call that failed), every
        active request ends and the slots are re-created, so the next requests decode again."""
        leaves = jax.tree.leaves(self.engine.states)
        if not any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
            return
        log.error("the engine's slot state was lost; ending %d active request(s) and re-creating the slots",
                  len(self.active) + len(self.admitting))
        for a in list(self.active.values()):
            self._finish(a, "error: the engine's slot state was lost in another request's failure")
        for adm in list(self.admitting.values()):
            self.admitting.pop(adm.slot)
            self._close(adm.req, adm.res, "error: the engine's slot state was lost in another request's failure")
        self._flights.clear()
        self._pending = None
        self.engine.set_slots(self.engine.n_slots)

    # ---- pipelined groups ------------------------------------------------------------------------------------------
    def _land(self, g: int) -> None:
        """Read group g's picks and keep counts (blocks on that group's last stage only) and apply them."""
        plan = self._flights.pop(g)
        try:
            picks, n_keep = np.asarray(plan.out["picks"]), np.asarray(plan.out["n_keep"])
        except Exception as e:
            self._window_failed(plan, e)
            return
        self._update(plan, picks, n_keep)

    def _launch(self, g: int, plan: WindowPlan) -> None:
        """Launch group g's next stage (and, after the last stage of a window, the per-stage commits with the
        device-side keep counts)."""
        eng = self.engine
        k = plan.next_stage
        if k == 0:
            plan.t_launch, plan.compiles0 = self.clock(), self._compiles()
            plan.toks_d = jnp.asarray(plan.toks)
        try:
            out, pending = eng.run_stage(k, plan.kind, plan.toks_d if k == 0 else plan.x, plan.rows, plan.toks_d,
                                         plan.samp)
            plan.pendings.append(pending)
            plan.next_stage = k + 1
            if plan.next_stage == len(eng.stages):
                plan.out = out
                if plan.kind == "window":
                    keep = out["n_keep"]  # stays on the device
                    for i, pd in enumerate(plan.pendings):
                        eng.commit_stage(i, plan.rows, pd, keep)
                plan.pendings = []
                self.stats["windows"] += 1
            else:
                plan.x = out["hidden"]
        except Exception as e:
            self._flights.pop(g, None)
            self._window_failed(plan, e)

    def _tick(self) -> None:
        """One pipeline tick: at most one launch per stage. In-flight groups advance first (deepest stage first,
        never waiting on the device); then one group at its window boundary reads its picks and launches stage 0."""
        busy = set()
        inflight = sorted(((fl.next_stage, g) for g, fl in self._flights.items() if fl.out is None), reverse=True)
        for k, g in inflight:
            if k not in busy and g in self._flights:
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
                slots = [s for s in self.groups[g] if s not in self.admitting]  # no dummy row on a half-read slot
                segs = [self.active.get(s) for s in slots]
                if not any(segs):
                    continue
                self._rr = g + 1
                plan = self._plan(slots, segs, self.props_per_window)
                if not any(a is not None for a in plan.active):
                    continue
                self._flights[g] = plan
                self._launch(g, plan)
                break
        self.stats["ticks"] += 1

    def _drain(self) -> None:
        """Finish every window in flight and apply every group's results (before an admission, a cancellation or
        the solo path takes a slot), and read the serial / solo window in flight."""
        self.stats["drains"] += 1
        self._settle()
        while any(fl.out is None for fl in self._flights.values()):
            for k, g in sorted(((fl.next_stage, g) for g, fl in self._flights.items() if fl.out is None),
                               reverse=True):
                if g in self._flights:
                    self._launch(g, self._flights[g])
        for g in sorted(self._flights):
            self._land(g)
