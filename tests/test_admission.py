"""Admission of a long prompt beside decoding slots (`BatchScheduler` with ``prefill_chunks``): the prompt is read
in chunks between the decoding slots' windows, and every request still decodes its solo tokens.

On the tiny qwen3next hybrid (recurrent GDN state, the case where a stray row would show) with the prefill chunk
lowered to 16 rows (for the solo references and the batch runs alike), a 60-token prompt (4 chunks) and a short one
arrive together while a third request decodes, in serial windows on one device and in pipelined groups on a
2-stage split. Checked: (a) each request's tokens equal its solo decode; (b) the order of events (prompt chunks, as
the engine launches them, and streamed tokens): the decoding request streams between the long prompt's chunks, at
most ``prefill_chunks`` chunks between two of its tokens (with 0, the old one-go read: none), and the queued short
prompt is read after the long one (FIFO) while both hold a slot; (c) the time to first token and the decode rate
beside the read are reported; and the admitted slot's state right after its read equals a one-go `Engine.prefill`
of the same prompt, leaf for leaf.
"""

import copy
from pathlib import Path

import jax
import numpy as np
import pytest

from strata_jax.pipeline.groups import resolve_groups
from strata_jax.pipeline.scheduler import BatchScheduler, Request
from strata_jax.pipeline.stages import slot_axes
from strata_jax.testing import exactness as bx

HYBRID = str(Path(__file__).parent / "fixtures" / "hybrid" / "qwen3next_f32.gguf")
CTX = 96
CHUNK = 16
BASE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]
_SOLO: dict = {}


def _engine(engine_for, n_slots, split=None):
    if not Path(HYBRID).exists():
        pytest.fail("committed hybrid fixture is missing (experiments/parity/make_hybrid_fixtures.py makes it)")
    n_dev = 2 if split else 1
    if len(jax.devices()) < n_dev:
        pytest.skip(f"needs {n_dev} devices (XLA_FLAGS=--xla_force_host_platform_device_count={n_dev})")
    return engine_for(HYBRID, max_context=CTX, n_slots=n_slots, layer_split=split, devices=jax.devices()[:n_dev])


def _requests(eng, n_decoding):
    """``n_decoding`` short requests from the start (greedy, then seeded), then at round 2 a 60-token prompt
    (seeded) and a short one (greedy) behind it."""
    V = eng.cfg.vocab_size
    reqs = [Request([t % V for t in BASE[:12 + 2 * i]], 14, bx.GREEDY if i == 0 else bx.seeded(7 + i), rid=f"d{i}")
            for i in range(n_decoding)]
    long = [(t * 7 + 3 * i) % V for i, t in enumerate(BASE * 4)][:60]
    assert -(-len(long) // CHUNK) == 4
    reqs.append(Request(long, 6, bx.seeded(3), arrival_round=2, rid="long"))
    reqs.append(Request([t % V for t in BASE[:9]], 5, bx.GREEDY, arrival_round=2, rid="q"))
    return reqs


def _slot_state(eng, slot):
    """Every state leaf's entries of ``slot`` on every stage (numpy), in tree order."""
    out = []
    for state, stage in zip(eng.states, eng.stages):
        axes = slot_axes(stage.module, eng.max_context, eng.kv_dtype)
        out += jax.tree.leaves(jax.tree.map(lambda x, ax: np.take(np.asarray(x), slot, axis=ax), state, axes))
    return out


def _run_recorded(eng, res, reqs, prefill_chunks, decode_steps=1):
    """Run ``reqs`` (``decode_steps`` steps per program where the scheduler may); returns (results, events,
    scheduler, the long request's slot state at its first token). Events: ("chunk", rid) per prefill chunk the
    engine reads, ("launch", k) per decode launch on stage k (a window or step on a stage), ("tok", rid) per
    streamed token."""
    # read_share 1: a chunk before every window, the order (b) checks (the share's own test: test_read_share_*)
    sch = BatchScheduler(eng, res, prefill_chunks=prefill_chunks, decode_steps=decode_steps, read_share=1.0)
    events, snap = [], {}
    by_slot = lambda s: next(r.rid for r in sch.results.values() if r.slot == s and not r.stop_reason)  # noqa: E731
    run, run_stage = eng.run, eng.run_stage

    def recording_run(kind, tokens, rows, sampling, logits="all"):
        if kind == "prefill":
            events.append(("chunk", by_slot(int(np.asarray(rows.slot)[0]))))
        return run(kind, tokens, rows, sampling, logits)

    def recording_run_stage(index, kind, *args, **kw):
        if kind != "prefill":
            events.append(("launch", index))
        return run_stage(index, kind, *args, **kw)

    def on_token(tok, rid):
        if rid == "long" and "long" not in snap:  # its read is done, no window has touched its slot yet
            snap["long"] = _slot_state(eng, sch.results["long"].slot)
        events.append(("tok", rid))

    mine = [copy.copy(r) for r in reqs]
    for r in mine:
        r.on_token = lambda t, rid=r.rid: on_token(t, rid)
    eng.run, eng.run_stage = recording_run, recording_run_stage
    try:
        results = sch.run(mine)
    finally:
        del eng.run, eng.run_stage  # the instance attributes go; the methods are back
    return results, events, sch, snap.get("long")


def _most_chunks_between(events, kind):
    """The longest run of prompt chunks with no event of ``kind`` (``tok``: a streamed token; ``launch``: a decode
    launch) between them."""
    run = most = 0
    for e in events:
        run = run + 1 if e[0] == "chunk" else 0 if e[0] == kind else run
        most = max(most, run)
    return most


def _check(eng, res, reqs, prefill_chunks, decoding_rids, per_token=True):
    """Run, then check (a), (b), (c) and the slot state (module doc). ``per_token``: each window streams every
    decoding request's token (serial windows), so at most ``prefill_chunks`` chunks lie between two tokens; in
    pipelined groups a window's tokens land a few ticks later, so the bound is checked on decode launches."""
    key = (id(eng), CHUNK)
    if key not in _SOLO:
        _SOLO[key] = [bx.solo_tokens(eng, r) for r in reqs]
    solo = _SOLO[key]
    results, events, sch, snap = _run_recorded(eng, res, reqs, prefill_chunks)
    got = {r.rid: r for r in results}
    # (a) exact: every request's tokens are its solo tokens
    for r, ref in zip(results, solo):
        assert r.tokens == ref and r.stop_reason == "max tokens", (prefill_chunks, r.rid, r.tokens, ref)
    # the long prompt's slot after its chunks == after a one-go prefill (same slot contents, leaf for leaf)
    assert snap is not None
    eng.prefill(0, list(reqs[-2].prompt_ids), reqs[-2].sampling)
    ref_state = _slot_state(eng, 0)
    assert len(snap) == len(ref_state)
    assert all(np.array_equal(a, b) for a, b in zip(snap, ref_state)), "admitted slot state differs from a prefill"
    # (b) the order of events
    chunks = [i for i, e in enumerate(events) if e == ("chunk", "long")]
    assert len(chunks) == 4 == got["long"].prefill_chunks
    read = events[chunks[0]:chunks[-1] + 1]
    between = [e for e in read if e[0] == "tok"]
    if prefill_chunks == 0:
        assert between == [] and _most_chunks_between(read, "launch") == 4, events  # one go: the others wait
    else:
        assert between and {rid for _, rid in between} <= set(decoding_rids), events  # they stream meanwhile
        assert _most_chunks_between(read, "tok" if per_token else "launch") <= prefill_chunks, events
    q_chunk = events.index(("chunk", "q"))
    assert q_chunk > chunks[-1], events  # FIFO: the short prompt queued behind the long one waits its turn
    assert got["q"].admitted_s <= got["long"].first_token_s < got["q"].first_token_s  # both held a slot at once
    # (c) time to first token (arrival to first token) and the rate beside the read
    for r in results:
        assert r.ttft_s is not None and r.ttft_s == r.first_token_s - r.arrival_s >= 0, r
        assert r.as_dict()["ttft_s"] == r.ttft_s and r.first_token_s >= r.admitted_s >= r.arrival_s
    st = sch.stats
    assert st["prefill_chunks"] == sum(r.prefill_chunks for r in results) == len(reqs) - 1 + 4
    if prefill_chunks:
        assert st["beside_prefill_steps"] + st["beside_prefill_compiled_steps"] >= 4 // prefill_chunks
    return sch


@pytest.mark.slow
@pytest.mark.parametrize("prefill_chunks", [1, 2, 0])
def test_long_prompt_read_between_serial_windows(engine_for, monkeypatch, prefill_chunks):
    """Serial windows on one device, 3 slots: one decoding, the long prompt and a short one queued behind it."""
    eng = _engine(engine_for, n_slots=3)
    monkeypatch.setattr(eng, "prefill_chunk", CHUNK)
    res = resolve_groups(3, 1)
    assert res.mode == "serial"
    sch = _check(eng, res, _requests(eng, 1), prefill_chunks, {"d0"})
    if prefill_chunks:
        assert sch.decode_beside_prefill() is not None and sch.decode_beside_prefill() > 0


@pytest.mark.slow
@pytest.mark.parametrize("decode_steps", [1, 3])
def test_long_prompt_admitted_beside_chained_serial_steps(engine_for, monkeypatch, decode_steps):
    """Two requests decode in chained serial steps on 3 slots (each step launched from the previous one's picks,
    with a dummy row on the idle slot) when the long prompt takes that idle slot: its read must not run beside a
    step chained from a window planned before it began (that window's dummy row on the slot would write into the
    half-read prompt). Every request's tokens equal its solo decode and the slot's state after the read equals a
    one-go prefill. Then the same with the long request cancelled mid-read: the steps after it run the layouts a
    fresh plan has (`BatchScheduler.step_program_rows`, those strata-serve's warm-up compiles), not the read's
    narrower one."""
    eng = _engine(engine_for, n_slots=3)
    monkeypatch.setattr(eng, "prefill_chunk", CHUNK)
    res = resolve_groups(3, 1)
    V = eng.cfg.vocab_size
    reqs = [Request([t % V for t in BASE[:12 + 2 * i]], 16, bx.GREEDY, rid=f"d{i}") for i in range(2)]
    long = [(t * 7 + 3 * i) % V for i, t in enumerate(BASE * 4)][:60]
    reqs.append(Request(long, 6, bx.GREEDY, arrival_round=3, rid="long"))
    key = (id(eng), CHUNK, "chained")
    if key not in _SOLO:
        _SOLO[key] = [bx.solo_tokens(eng, r) for r in reqs]
    solo = _SOLO[key]
    results, events, sch, snap = _run_recorded(eng, res, reqs, 1, decode_steps)
    assert sch.stats["chained"] > 0 and sch.stats["prefill_chunks"] == 2 + 4
    for r, ref in zip(results, solo):
        assert r.tokens == ref, (decode_steps, r.rid, r.tokens, ref)
    eng.prefill(0, list(long), bx.GREEDY)
    ref_state = _slot_state(eng, 0)
    assert snap is not None and len(snap) == len(ref_state)
    assert all(np.array_equal(a, b) for a, b in zip(snap, ref_state)), "the read slot's state differs from a prefill"
    # the long request cancelled between two chunks of its read
    rows = []
    run_steps = eng.run_steps

    def recording_run_steps(token, rows_, sampling, n_steps):
        rows.append(int(np.shape(token)[0]))
        return run_steps(token, rows_, sampling, n_steps)

    cancel = [copy.copy(r) for r in reqs]
    cancel[2].cancel_round = 5
    # read_share 1: a chunk before every window, so some are read by round 5 (at 0.5 the first chunk may wait for
    # the windows to pay back the decoding requests' own prompt reads, and none be read before the cancel)
    sch = BatchScheduler(eng, res, decode_steps=decode_steps, read_share=1.0)
    eng.run_steps = recording_run_steps
    try:
        got = {r.rid: r for r in sch.run(cancel)}
    finally:
        del eng.run_steps  # the method is back
    assert got["long"].stop_reason == "cancelled" and 0 < got["long"].prefill_chunks < 4
    assert got["d0"].tokens == solo[0] and got["d1"].tokens == solo[1]
    assert (rows != []) == (decode_steps > 1) and set(rows) <= set(sch.step_program_rows), rows


@pytest.mark.slow
def test_long_prompt_read_between_pipeline_ticks(engine_for, monkeypatch):
    """Pipelined groups (2 stages, 2 groups of 2 slots): two decoding, the long prompt's group windows leave its
    slot out while it is read."""
    eng = _engine(engine_for, n_slots=4, split="2")
    monkeypatch.setattr(eng, "prefill_chunk", CHUNK)
    res = resolve_groups(4, 2)
    assert res.mode == "pipelined" and res.n_groups == 2
    sch = _check(eng, res, _requests(eng, 2), 1, {"d0", "d1"}, per_token=False)
    assert sch.stats["ticks"] > 0 and sch.stats["drains"] > 0


def test_prefill_chunks_flag_names_the_chunk(engine_for):
    """The --batch_prefill_chunks help states the engine's chunk size; a negative value is refused."""
    from strata_jax.cli import flags
    from strata_jax.errors import StrataError

    assert "(--prefill_chunk tokens each)" in flags.FLAGS["batch_prefill_chunks"].help
    eng = _engine(engine_for, n_slots=3)
    with pytest.raises(StrataError, match="must be >= 0"):
        BatchScheduler(eng, resolve_groups(3, 1), prefill_chunks=-1)


def _scripted_clock(eng, now, events, admitting=lambda: False):
    """Wrap ``eng``'s run / run_stage / run_steps (restore with ``del eng.run, eng.run_stage, eng.run_steps``): the
    clock ``now[0]`` advances 1/8 s per prompt chunk and 1/32 s per decode step; ``events`` gets "chunk", "launch"
    (a one-step window) or ("steps", ``admitting()``) per program."""
    run, run_stage, run_steps = eng.run, eng.run_stage, eng.run_steps

    def timed_run(kind, tokens, rows, sampling, logits="all"):
        if kind == "prefill":
            now[0] += 0.125
            events.append("chunk")
        return run(kind, tokens, rows, sampling, logits)

    def timed_run_stage(index, kind, *args, **kw):
        if kind != "prefill":
            now[0] += 0.03125
            events.append("launch")
        return run_stage(index, kind, *args, **kw)

    def timed_run_steps(token, rows, sampling, n_steps):
        now[0] += 0.03125 * n_steps
        events.append(("steps", admitting()))
        return run_steps(token, rows, sampling, n_steps)

    eng.run, eng.run_stage, eng.run_steps = timed_run, timed_run_stage, timed_run_steps


def _share_requests(eng, n_new):
    """A request decoding ``n_new`` tokens from the start, and a 64-token prompt (4 chunks) arriving at round 2."""
    V = eng.cfg.vocab_size
    long = [(t * 7 + 3 * i) % V for i, t in enumerate(BASE * 4)][:64]
    return [Request([t % V for t in BASE[:12]], n_new, bx.GREEDY, rid="d0"),
            Request(long, 2, bx.GREEDY, arrival_round=2, rid="long")]


@pytest.mark.parametrize("share,n_chunks,gaps", [(0.5, 1, [4] * 3), (0.2, 1, [16] * 3), (1.0, 1, [1] * 3),
                                                 (0.5, 2, [0, 8, 0])])
def test_read_share_gives_the_decoding_slot_its_time(engine_for, monkeypatch, share, n_chunks, gaps):
    """``read_share``: with a clock that advances 1/8 s per prompt chunk and 1/32 s per decode launch, the windows
    between two chunks of the long read earn the chunk's time x (1 - share) / share: the chunk's own step's window
    and 3 more at 0.5, 15 more at 0.2, none more at 1 (a chunk before every window); with 2 chunks per step
    (``prefill_chunks``) they go together and the windows earn both; the decoding slot's tokens
    are its solo tokens and the stats' rate beside the read is about 1 - share of its rate alone (32 tok/s on this
    clock). A share outside (0, 1] is refused."""
    from strata_jax.errors import StrataError

    eng = _engine(engine_for, n_slots=2)
    monkeypatch.setattr(eng, "prefill_chunk", CHUNK)
    res = resolve_groups(2, 1)
    reqs = _share_requests(eng, 4 + 2 * sum(gaps))
    key = (id(eng), CHUNK, "share", sum(gaps))
    if key not in _SOLO:
        _SOLO[key] = [bx.solo_tokens(eng, r) for r in reqs]
    now, events = [0.0], []
    _scripted_clock(eng, now, events)
    try:
        for warm in (True, False):   # the first run compiles the 2-slot windows (a compiling step earns nothing)
            events.clear()
            sch = BatchScheduler(eng, res, read_share=share, prefill_chunks=n_chunks, clock=lambda: now[0])
            got = {r.rid: r for r in sch.run([copy.copy(r) for r in reqs])}
    finally:
        del eng.run, eng.run_stage, eng.run_steps
    assert [got[r.rid].tokens for r in reqs] == _SOLO[key]
    chunks = [i for i, e in enumerate(events) if e == "chunk"]
    assert len(chunks) == 1 + 64 // CHUNK, events   # d0's prompt, then the long one's 4 chunks
    chunks = chunks[1:]
    got_gaps = [b - a - 1 for a, b in zip(chunks, chunks[1:])]
    assert got_gaps == gaps, (share, n_chunks, got_gaps, events)
    st = sch.stats
    assert st["beside_prefill_steps"] >= sum(gaps)
    # the rate beside the read: its launches (a token each) over their time and the chunks', from the first chunk's
    # step to the last one's window; ~1 - share of the 32 tok/s alone when the windows between chunks dominate
    span = events[chunks[0]:chunks[-1] + 2]
    n_tok = span.count("launch")
    assert sch.decode_beside_prefill() == pytest.approx(n_tok / (0.125 * span.count("chunk") + 0.03125 * n_tok))
    if share < 1 and n_chunks == 1:
        assert sch.decode_beside_prefill() >= 32 * (1 - share) * 0.8, (st, sch.decode_beside_prefill())
    with pytest.raises(StrataError, match="read_share"):
        BatchScheduler(eng, res, read_share=0.0)
    with pytest.raises(StrataError, match="read_share"):
        BatchScheduler(eng, res, read_share=1.5)


def test_read_share_lets_steps_programs_run_while_the_read_waits(engine_for, monkeypatch):
    """With ``decode_steps`` 3, the decoding slot runs programs of 3 steps while the read waits for its share (its
    window has the one row a lone request's program has); its tokens and the long request's are their solo tokens."""
    eng = _engine(engine_for, n_slots=2)
    monkeypatch.setattr(eng, "prefill_chunk", CHUNK)
    res = resolve_groups(2, 1)
    reqs = _share_requests(eng, 40)
    key = (id(eng), CHUNK, "share_steps")
    if key not in _SOLO:
        _SOLO[key] = [bx.solo_tokens(eng, r) for r in reqs]
    now, events, box = [0.0], [], []
    _scripted_clock(eng, now, events, admitting=lambda: bool(box[0].admitting))
    try:
        box.append(BatchScheduler(eng, res, read_share=0.5, decode_steps=3, clock=lambda: now[0]))
        got = {r.rid: r for r in box[0].run([copy.copy(r) for r in reqs])}
    finally:
        del eng.run, eng.run_stage, eng.run_steps
    assert [got[r.rid].tokens for r in reqs] == _SOLO[key]
    chunks = [i for i, e in enumerate(events) if e == "chunk"][1:]   # after d0's own prompt: the long one's 4
    assert len(chunks) == 4, events
    assert ("steps", True) in events[chunks[0]:chunks[-1]], events   # programs of 3 steps while the read waited
