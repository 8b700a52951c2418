"""The solo path: one sequence, prefill then decode windows, streamed.

Plain decoding runs one-row windows with the commit fused in (one jitted call per stage per token). With a proposer
(`strata_jax.proposers`), each window carries the last accepted token plus up to T-1 proposals; the picks decide
``n_keep`` by exact match and the commit advances the state by the kept rows, so the output is
token for token what plain decoding gives.

Both loops keep the device busy while the host works: the next step or window is launched before the host reads
the previous one's result (JAX dispatch is asynchronous), and the host's per-token work (the stop rule,
detokenizing and streaming: `Sequence.push` / `Sequence.flush`) runs while the device computes. A plain step's
tokens go from one step to the next on the device. A round launched past the end of the sequence (EOS or a stop
string, found a round late) is dropped: the output and the streamed tokens are those of the synchronous loop.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.errors import StrataError
from strata_jax.pipeline.engine import Engine, check_decode_steps
from strata_jax.pipeline.sequence import Sequence
from strata_jax.pipeline.stages import MAX_WINDOW
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows


RATE_MIN_S = 0.05   # a rate over less measured time than this is not given (a figure, not a rate)


@dataclasses.dataclass
class GenerationStats:
    """Counters of one generation (times in seconds)."""

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    generated: int = 0
    decode_seconds: float = 0.0
    windows: int = 0
    stop_reason: str = ""
    # speculative decoding (zero / empty on the plain path)
    spec: int = 0
    proposer: str = ""
    proposed: int = 0
    accepted: int = 0
    per_proposer: dict = dataclasses.field(default_factory=dict)
    offered_at: list = dataclasses.field(default_factory=list)
    accepted_at: list = dataclasses.field(default_factory=list)
    spec_windows: int = 0
    stepped_aside: int = 0
    window_tokens: dict = dataclasses.field(default_factory=dict)
    window_seconds: float = 0.0
    propose_seconds: float = 0.0
    compiles: int = 0
    policy: dict = dataclasses.field(default_factory=dict)
    # windows during which something compiled (first call of a window shape: compile + its own run): the rates
    # and ms/window leave them out, their tokens and their time both (see `decode_tok_s`)
    compiled_windows: int = 0
    compiled_window_tokens: int = 0
    compiled_window_seconds: float = 0.0   # their engine calls (as window_seconds counts them)
    compiled_round_seconds: float = 0.0    # their whole rounds, proposing included (as decode_seconds counts them)
    prefill_compiled: bool = False
    # steps launched ahead of a result that ended the sequence (EOS, stop string) and dropped unread: not in
    # ``windows``, their time (device time the host did not wait for) not in any rate
    dropped: int = 0
    ahead: int = 0  # plain steps launched from the previous step's pick before that step was read
    decode_steps: int = 1  # plain decode steps per device call (`Engine.run_steps`)
    step_programs: int = 0  # calls that ran decode_steps steps (the other windows: single steps)

    def add_compiled_window(self, tokens: int, window_seconds: float, round_seconds: float) -> None:
        """Count a window during which something compiled: its kept ``tokens``, its engine-call seconds (as
        ``window_seconds`` counts them) and its whole round's seconds (as ``decode_seconds`` counts them), all left
        out of the rates."""
        self.compiled_windows += 1
        self.compiled_window_tokens += tokens
        self.compiled_window_seconds += window_seconds
        self.compiled_round_seconds += round_seconds

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens per second of the prefill; when the prefill compiled (``prefill_compiled``) the time
        includes that compile (there is no other run to measure)."""
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_measured(self) -> int:
        """Tokens the decode rate counts: those of the windows after the prefill that did not compile."""
        return max(self.generated - 1 - self.compiled_window_tokens, 0)

    @property
    def decode_seconds_measured(self) -> float:
        """Seconds the decode rate counts: the decode time less the rounds during which something compiled."""
        return max(self.decode_seconds - self.compiled_round_seconds, 0.0)

    @property
    def decode_rate_measured(self) -> bool:
        """Whether the decode rate is a rate: tokens measured over at least `RATE_MIN_S` seconds."""
        return self.decode_tokens_measured > 0 and self.decode_seconds_measured >= RATE_MIN_S

    @property
    def decode_tok_s(self) -> float:
        """Decode rate over the windows that did not compile (their tokens / their time); 0.0 when every window
        compiled (nothing measured). Not a rate under `RATE_MIN_S` (see `decode_rate_measured`)."""
        n = self.decode_tokens_measured
        t = self.decode_seconds_measured
        return n / t if n > 0 and t > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / offered proposals."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_window(self) -> float:
        """Tokens committed per decode window (the first token comes from the prefill)."""
        return max(self.generated - 1, 0) / self.windows if self.windows else 0.0

    @property
    def window_ms(self) -> float:
        """Mean wall time of a decode window (engine call + commit), in ms, over the windows that did not compile
        (0.0 when every window compiled)."""
        n = self.windows - self.compiled_windows
        return (self.window_seconds - self.compiled_window_seconds) * 1e3 / n if n > 0 else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(prefill_tok_s=self.prefill_tok_s,
                 # null when every window compiled or under RATE_MIN_S measured
                 decode_tok_s=self.decode_tok_s if self.decode_rate_measured else None,
                 decode_seconds_measured=self.decode_seconds_measured,
                 acceptance_rate=self.acceptance_rate, tokens_per_window=self.tokens_per_window,
                 window_ms=self.window_ms if self.windows > self.compiled_windows else None,
                 decode_tokens_measured=self.decode_tokens_measured,
                 rate_rule="decode_tok_s and window_ms leave out the windows that compiled (their tokens and their "
                           "time); decode_tok_s is null when every window compiled or under "
                           f"{RATE_MIN_S * 1e3:.0f} ms were measured; prefill_tok_s includes the compile when "
                           "prefill_compiled")
        d["window_tokens"] = {str(k): v for k, v in sorted(self.window_tokens.items())}
        return d

    def spec_summary(self) -> str:
        """One part of the stats line, in words: ``lookup proposals (window cap 4): 12 of 30 accepted (40%), 1.9 tok
        per window, 31.0 ms per window, 5 ms proposing, stepped aside for 2 windows`` (stepping aside: the policy
        ran plain steps where proposing did not pay); ``none offered`` when the proposer found nothing."""
        if not self.spec:
            return ""
        head = f"{self.proposer} proposals (window cap {self.spec}): "
        aside = f", stepped aside for {self.stepped_aside} window{'' if self.stepped_aside == 1 else 's'}"
        if not self.proposed:
            return head + f"none offered ({self.propose_seconds * 1e3:.0f} ms looking)" + (
                aside if self.stepped_aside else "")
        ms = f", {self.window_ms:.1f} ms per window" if self.windows > self.compiled_windows else ""
        return (head + f"{self.accepted} of {self.proposed} accepted ({100 * self.acceptance_rate:.0f}%), "
                f"{self.tokens_per_window:.2f} tok per window{ms}, {self.propose_seconds * 1e3:.0f} ms proposing"
                + (aside if self.stepped_aside else ""))


@dataclasses.dataclass
class Generation:
    """Result: the generated token ids (EOS included when it ended the generation), stats, and with
    ``dump_logits`` the prompt's logits [T, V] and the logits each generated token was picked from [S, V]."""

    tokens: list[int]
    stats: GenerationStats
    prefill_logits: np.ndarray | None = None
    step_logits: np.ndarray | None = None


@dataclasses.dataclass
class _Call:
    """One plain decode call of the solo loop, launched and not read yet: its picks int32 [1, n] and last pick [1, 1]
    (device arrays), row 0's position, its step count, and (``dump_logits``, one step) its logits."""

    picks: object
    last: object
    pos: int
    n: int
    logits: object = None


@dataclasses.dataclass
class _Round:
    """One round of the speculative solo loop, launched and not read yet: its proposals, the last stage's outputs
    (device arrays) and row 0's position; ``aside``: a plain step the policy chose; ``asked``: the proposer was
    asked with the history this round starts from."""

    props: list
    out: dict
    pos: int
    aside: bool = False
    asked: bool = False


def compile_ahead_enabled() -> bool:
    """``STRATA_COMPILE_AHEAD`` (default 1): whether `generate` compiles the decode program beside the prefill
    (`Engine.compile_steps_ahead`), and strata-serve's warm-up its programs of several steps beside its other
    programs (`BatchScheduler.compile_steps_ahead`); 0 compiles them one after the other (A/B runs of a cold
    start: the first token comes a little sooner, the whole start later).

    Raises:
      UnsupportedError: another value."""
    from strata_jax.pallas.dispatch import env_choice

    return env_choice("STRATA_COMPILE_AHEAD", "1", ("0", "1")) == "1"


def generate(engine: Engine, prompt_ids: list[int], *, max_new_tokens: int = 256,
             sampling: SamplingParams = SamplingParams(), eos_ids=(), stop: Callable[[list[int]], bool] | None = None,
             on_token: Callable[[int], None] | None = None, slot: int = 0, dump_logits: bool = False,
             proposer=None, spec: int = 0, spec_min_p: float = 0.0, policy=None,
             on_prefill_chunk: Callable[[int, int], None] | None = None, decode_steps: int = 1) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` in ``slot``.

    Args:
      engine: a loaded engine.
      prompt_ids: the prompt's token ids.
      max_new_tokens: most tokens generated.
      sampling: sampler settings (greedy when temperature <= 0).
      eos_ids: ids that end the generation (included in the output, not streamed).
      stop: called with the tokens so far after each token; True ends the generation (stop strings).
      on_token: called with each new token id (streaming).
      dump_logits: keep float32 logits (prompt and each step).
      proposer: a `strata_jax.proposers.Proposer`; with ``spec >= 2`` the decode is speculative (same output).
      spec: the window cap T (2..8): the last accepted token + up to T-1 proposals per window.
      spec_min_p: cut proposals at the first one whose proposer probability is below this (0 = off).
      policy: a `strata_jax.proposers.SpecPolicy` letting the proposer step aside when it does not pay
        (None: always ask it).
      on_prefill_chunk: ``on_prefill_chunk(read, len(prompt_ids))`` after each prompt chunk (`Engine.prefill`).
      decode_steps: plain decode steps per device program (`Engine.run_steps`; the same tokens, streamed in
        bursts of this many): used where the engine allows it (`Engine.can_run_steps`) and logits are not dumped,
        else 1. The budget's last tokens (fewer than ``decode_steps``) run in one more such program whose extra
        steps are dropped (no second program to compile, ~40 s on a GPU for the 1.5B shape); within
        ``decode_steps`` cells of the context end they run one step per call, so no step writes past it.

    Returns:
      `Generation`.

    Raises:
      StrataError: the prompt does not fit the context; ``spec`` outside 2..8 with a proposer; ``decode_steps`` < 1;
        ``STRATA_COMPILE_AHEAD`` not 0 or 1 (`compile_ahead_enabled`).
    """
    decode_steps = check_decode_steps(decode_steps)
    ahead = compile_ahead_enabled()
    if proposer is not None and spec:
        if not 2 <= spec <= MAX_WINDOW:
            raise StrataError(f"--spec {spec}: the window cap must lie in 2..{MAX_WINDOW}")
        return _generate_spec(engine, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids,
                              stop=stop, on_token=on_token, slot=slot, dump_logits=dump_logits, proposer=proposer,
                              spec=int(spec), spec_min_p=float(spec_min_p), policy=policy,
                              on_prefill_chunk=on_prefill_chunk)
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    t0 = time.perf_counter()
    c0 = engine.cache.compiles
    steps = decode_steps if (not dump_logits and engine.can_run_steps) else 1

    def runs_steps(pos: int, budget: int) -> bool:
        """A call at ``pos`` with ``budget`` tokens left runs ``steps`` steps in one program (`launch`): not
        within ``steps`` cells of the context end, unless the budget ends first."""
        return steps > 1 and (budget >= steps or pos + steps <= engine.max_context)

    # the decode program compiles while the prefill does (a cold start), when the first call after the prefill
    # will run it (position and budget after the prefill's token, as `Sequence` gives them)
    P = len(prompt_ids)
    budget = min(max_new_tokens - 1, engine.max_context - 1 - P)
    if ahead and budget >= 1 and runs_steps(P, budget):
        engine.compile_steps_ahead([slot], RowSampling.make([sampling]), steps)
    first, prefill_logits = engine.prefill(slot, list(prompt_ids), sampling, all_logits=dump_logits,
                                           on_chunk=on_prefill_chunk)
    stats.prefill_seconds = time.perf_counter() - t0
    stats.prefill_compiled = engine.cache.compiles != c0
    step_logits: list[np.ndarray] = []
    if dump_logits:
        step_logits.append(prefill_logits[-1])
    samp = RowSampling.make([sampling])
    seq = Sequence(prompt_ids, max_new_tokens=max_new_tokens, max_context=engine.max_context, eos_ids=eos_ids,
                   stop=stop, on_token=on_token)
    tokens = seq.tokens
    t1 = time.perf_counter()
    seq.emit(first)
    c_prev = engine.cache.compiles
    stats.decode_steps = steps
    # One call ahead: call i + 1 is launched from call i's last pick, still on the device, before the host reads
    # call i and streams it, so the device runs call i + 1 while the host works. A call is one step, or ``steps``
    # steps in one program. When call i ends the sequence (EOS, a stop string, max_new_tokens; for a call of
    # several steps, at any of them), what ran past the end is dropped: it wrote K/V cells and state past the end
    # of this sequence, which the next prefill in this slot resets (`Engine.prefill` from position 0). No step
    # writes past the context end: there the last tokens run one step per call.

    def launch(token, pos: int, budget: int) -> _Call:
        if runs_steps(pos, budget):
            stats.step_programs += 1
            out = engine.run_steps(token, Rows.make([slot], [pos], [1]), samp, steps)
            return _Call(out["picks"], out["last"], pos, min(steps, budget))
        out, pos = _launch_step(engine, slot, token, pos, samp)
        return _Call(out["picks"], out["picks"], pos, 1, out.get("logits") if dump_logits else None)

    cur = None if seq.reason else launch(np.array([[seq.last]], np.int32), seq.pos, seq.budget)
    t_prev = t1
    overlapped = False  # the call read now compiled at its launch, in the previous interval
    while cur is not None:
        rest = seq.budget - cur.n  # tokens the budget leaves once this call's are emitted
        c_launch = engine.cache.compiles
        nxt = launch(cur.last, cur.pos + cur.n, rest) if rest >= 1 else None
        nxt_compiled = engine.cache.compiles != c_launch
        stats.ahead += nxt is not None
        picks = np.asarray(cur.picks)[0]  # waits for this call only
        n0 = len(tokens)
        for t in picks[:cur.n]:
            if seq.push(int(t)):
                break
        if dump_logits:
            step_logits.append(np.asarray(cur.logits)[0, 0])
        seq.flush()
        now, c_now = time.perf_counter(), engine.cache.compiles
        stats.window_seconds += now - t_prev
        stats.windows += 1
        # an interval that compiled, and the one that reads a call whose launch compiled (it ran while the host
        # compiled, so its read takes no time): tokens and time left out of the rate
        if c_now != c_prev or overlapped:
            stats.add_compiled_window(len(tokens) - n0, now - t_prev, now - t_prev)
        overlapped = nxt_compiled
        t_prev, c_prev = now, c_now
        if seq.reason:
            stats.dropped += nxt is not None
            break
        cur = nxt if nxt is not None else launch(np.array([[seq.last]], np.int32), seq.pos, seq.budget)
    stats.stop_reason = seq.reason
    stats.decode_seconds = time.perf_counter() - t1
    stats.generated = len(tokens)
    return Generation(tokens, stats, prefill_logits,
                      np.stack(step_logits) if dump_logits else None)


def _launch_step(engine: Engine, slot: int, token, pos: int, samp: RowSampling):
    """Launch one plain decode step (commit fused in) of ``token`` (int32 [1, 1], numpy or the previous step's
    picks on the device) at ``pos`` in ``slot``, without waiting; returns (the last stage's outputs, ``pos``)."""
    out, _ = engine.run("step", token, Rows.make([slot], [pos], [1]), samp)
    return out, pos


def _generate_spec(engine: Engine, prompt_ids: list[int], *, max_new_tokens, sampling, eos_ids, stop, on_token, slot,
                   dump_logits, proposer, spec: int, spec_min_p: float, policy,
                   on_prefill_chunk=None) -> Generation:
    """The speculative solo loop: each window is the last accepted token + up to ``spec - 1``
    proposals at consecutive positions; the engine's exact-match ``n_keep`` decides the kept prefix, which is then
    cut at EOS / max tokens / context end (`Sequence.push_window`) and at a stop string (`Sequence.flush`, after
    the next round is launched) exactly where plain decoding would stop; recurrent state is committed by the
    kept rows right after the window's launch, with the keep count on the device (a cut ends the sequence, so rows
    committed past it are never read: the next prefill in the slot resets them); the bonus pick starts the next
    window.

    Windows with proposals always use the shape [1, spec] (padded rows are invalid), rounds without proposals a
    one-row ``step``: two compiled window functions per model.
    """
    stats = GenerationStats(prompt_tokens=len(prompt_ids), spec=spec, proposer=getattr(proposer, "name", "?"),
                            offered_at=[0] * (spec - 1), accepted_at=[0] * (spec - 1))
    pstats = stats.per_proposer.setdefault(stats.proposer, {"offered": 0, "accepted": 0, "windows": 0})
    compiles0 = engine.cache.compiles
    d_eng = getattr(proposer, "engine", None)
    d_cache = d_eng.cache if d_eng is not None and d_eng is not engine else None

    def n_compiles() -> int:
        return engine.cache.compiles + (d_cache.compiles if d_cache is not None else 0)

    aside0 = policy.stepped_aside if policy is not None else 0
    proposer.reset()
    if hasattr(proposer, "bind"):
        proposer.bind(slot)  # proposers that keep per-slot state on the device (MTP)
    t0 = time.perf_counter()
    c_pre = n_compiles()
    first, prefill_logits = engine.prefill(slot, list(prompt_ids), sampling, all_logits=dump_logits,
                                           on_chunk=on_prefill_chunk)
    stats.prefill_seconds = time.perf_counter() - t0
    stats.prefill_compiled = n_compiles() != c_pre
    step_logits: list[np.ndarray] = []
    if dump_logits:
        step_logits.append(prefill_logits[-1])
    samp = RowSampling.make([sampling])
    seq = Sequence(prompt_ids, max_new_tokens=max_new_tokens, max_context=engine.max_context, eos_ids=eos_ids,
                   stop=stop, on_token=on_token, proposer=proposer, spec_min_p=spec_min_p)
    tokens = seq.tokens
    t1 = time.perf_counter()
    seq.emit(first)

    def propose() -> list[int]:
        tp = time.perf_counter()
        props = seq.propose(spec - 1)
        stats.propose_seconds += time.perf_counter() - tp
        return props

    def launch(token, pos: int, props: list[int], aside: bool = False, asked: bool = False) -> _Round:
        """Launch a round without waiting: a [1, spec] window of ``token`` + ``props``, or a one-row step when there
        are no proposals. ``token``: an int, or the previous step's pick still on the device (int32 [1, 1])."""
        k = len(props)
        if k:
            toks = np.zeros((1, spec), np.int32)
            toks[0, 1:1 + k] = props
            if isinstance(token, int):
                toks[0, 0] = token
            else:  # the pick on the device, then the proposals: one small device op, no host wait
                toks = jnp.concatenate([token, jnp.asarray(toks[:, 1:])], axis=1)
            rows = Rows.make([slot], [pos], [1 + k])
            out, pending = engine.run("window", toks, rows, samp)
            if any(pd is not None for pd in pending):
                # committed by the device's keep count, with no host wait; a push cuts the kept rows only at the
                # sequence's end (EOS, a stop string: `Sequence.room` keeps windows inside max tokens and the
                # context), after which the slot's state is never read again
                engine.commit(rows, pending, out["n_keep"])
        else:
            if isinstance(token, int):
                token = np.array([[token]], np.int32)
            rows = Rows.make([slot], [pos], [1])
            out, _ = engine.run("step", token, rows, samp)
        return _Round(props, out, pos, aside, asked)

    def use_proposer(ahead: int) -> bool | None:
        """The policy's choice for a round planned ``ahead`` tokens from now (None: no room for proposals, the
        policy is not asked)."""
        if seq.room(spec - 1, ahead=ahead) <= 0:
            return None
        return policy is None or policy.use_proposer()

    # Overlap: a round's host work after its read (streaming, stop strings, statistics) runs while the device
    # computes the next round, which is launched first. A plain step is moreover launched before the previous
    # plain step is read, from its pick still on the device, when the policy steps the proposer aside or a
    # host-side proposer (`Proposer.host_side`) had nothing to propose: the device then never waits for the host.
    # Such a proposer is asked again, with the history the step launched ahead starts from, while that step runs;
    # if it now proposes p1..pk (p1: its guess of that step's pick), a window of the step's pick (on the device)
    # + p2..pk is launched right behind the step: verification is exact whatever the pick is. A round launched
    # past the end of the sequence (EOS, a stop string found in the flush) is dropped unread: it wrote K/V cells
    # (and a step, state) past the end, which the next prefill in this slot resets.
    dry = False     # the proposer's last answer was empty
    decided = None  # the policy's choice for the next round to plan, when made before its planning
    flight: collections.deque[_Round] = collections.deque()
    t_prev, c_prev = t1, n_compiles()

    def plan() -> _Round:
        """Plan the next round from the pushed history and launch it."""
        nonlocal dry, decided
        use = decided if decided is not None else use_proposer(0)
        decided = None
        props: list[int] = []
        if use:
            props = propose()
            dry = not props
        return launch(seq.last, seq.pos, props, asked=bool(use))

    if not seq.reason:
        flight.append(plan())
    while flight:
        cur = flight[0]
        # 1. the next round, when it is a plain step, is launched now from this step's pick
        if len(flight) == 1 and not cur.props and seq.budget >= 2:
            use = decided if decided is not None else use_proposer(1)
            decided = None
            if not use or (dry and proposer.host_side):
                flight.append(launch(cur.out["picks"], cur.pos + 1, [], aside=use is False))
                stats.ahead += 1
            else:
                decided = use
        # 2. read this round (waits for it) and push its tokens: EOS, max tokens, context end
        flight.popleft()
        picks, n_keep = jax.device_get((cur.out["picks"], cur.out["n_keep"]))
        k = len(cur.props)
        n_keep = int(n_keep[0]) if k else 1
        pushed = len(seq.push_window(cur.props, picks[0], n_keep))
        # 3. the next round, planned now from the pushed history unless launched already
        if not seq.reason and not flight:
            flight.append(plan())
        # 4. stream and check the stop strings while the device runs the next round
        n0 = len(tokens)
        seq.flush()
        kept = pushed - (n0 - len(tokens))  # a stop string found in the flush cuts this round's tokens
        if dump_logits:
            lg = np.asarray(cur.out["logits"])[0]
            step_logits.extend(lg[j] for j in range(kept))
        # 5. a step launched ahead because the proposer was dry: ask it again (see above)
        nxt = flight[0] if flight else None
        if (not seq.reason and len(flight) == 1 and not nxt.props and not nxt.aside and not nxt.asked
                and dry and proposer.host_side and seq.budget >= 2):
            props = propose()
            dry = not props
            if props:
                use = use_proposer(1)
                tail = props[1:1 + seq.room(spec - 1, ahead=1)]
                if use and tail:
                    flight.append(launch(nxt.out["picks"], nxt.pos + 1, tail, asked=True))
                    stats.ahead += 1
                elif use is False:
                    flight.append(launch(nxt.out["picks"], nxt.pos + 1, [], aside=True))
                    stats.ahead += 1
                else:
                    decided = use
        now, c_now = time.perf_counter(), n_compiles()
        dt, compiled = now - t_prev, c_now != c_prev
        t_prev, c_prev = now, c_now
        stats.window_seconds += dt
        stats.windows += 1
        if compiled:  # proposing, the round or its commit compiled: out of the rates (tokens and time)
            stats.add_compiled_window(kept, dt, dt)
        stats.window_tokens[kept] = stats.window_tokens.get(kept, 0) + 1
        if k:
            acc = n_keep - 1
            stats.spec_windows += 1
            stats.proposed += k
            stats.accepted += acc
            pstats["offered"] += k
            pstats["accepted"] += acc
            pstats["windows"] += 1
            for i in range(k):
                stats.offered_at[i] += 1
                if i < acc:
                    stats.accepted_at[i] += 1
        if policy is not None:
            policy.record("spec" if k else "plain", 1 + k, kept, dt, compiled=compiled)
        if seq.reason:
            stats.dropped += len(flight)
            break
    stats.stop_reason = seq.reason
    stats.decode_seconds = time.perf_counter() - t1
    stats.generated = len(tokens)
    stats.compiles = engine.cache.compiles - compiles0
    if policy is not None:
        stats.stepped_aside = policy.stepped_aside - aside0
        stats.policy = policy.table()
    return Generation(tokens, stats, prefill_logits,
                      np.stack(step_logits) if dump_logits else None)
