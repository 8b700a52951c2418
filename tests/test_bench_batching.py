"""The pure parts of the batching benchmark (experiments/bench_batching.py, issue 7), in `strata_jax.testing.batching`:
acceptance draws, the replay proposer, recorded profiles (``replay``), the summary / goal computation and the report
(``report``), workloads and arms (``workload``); and that replayed proposals never change a scheduler run's output
(tiny hybrid model)."""

import copy
from pathlib import Path

import jax
import numpy as np
import pytest

from strata_jax.sampling import SamplingParams
from strata_jax.testing.batching import replay
from strata_jax.testing.batching import report
from strata_jax.testing.batching import workload

HYBRID = str(Path(__file__).parent / "fixtures" / "hybrid" / "qwen3next_f32.gguf")


# ---- acceptance draws ----------------------------------------------------------------------------------------------
def test_fixed_rate_is_met_and_deterministic():
    acc = replay.Acceptance.fixed(0.7)
    draws = [acc.decide(key, j, 1) for key in range(3) for j in range(1000)]
    assert all(o == 1 for o, _ in draws)  # a fixed rate always offers the room
    rate = np.mean([a for _, a in draws])
    assert abs(rate - 0.7) < 0.03, rate
    assert draws == [acc.decide(key, j, 1) for key in range(3) for j in range(1000)]  # same draws every time
    assert acc.decide(1, 5, 0) == (0, 0)
    assert replay.Acceptance.fixed(1.0).decide(3, 9, 4) == (4, 4)
    assert replay.Acceptance.fixed(0.0).decide(3, 9, 4) == (4, 0)
    with pytest.raises(ValueError):
        replay.Acceptance.fixed(1.5)


def test_chained_acceptance_is_consistent_across_window_caps():
    """Proposal k is accepted with p given 1..k-1 were; a smaller cap sees the same first draws."""
    acc = replay.Acceptance.fixed(0.8)
    for j in range(300):
        o3, a3 = acc.decide(11, j, 3)
        o1, a1 = acc.decide(11, j, 1)
        assert (o3, o1) == (3, 1) and a1 == min(a3, 1)
    full = np.mean([acc.decide(5, j, 3)[1] == 3 for j in range(3000)])
    assert abs(full - 0.8 ** 3) < 0.03, full


def test_profile_from_positions_and_its_replay():
    offered = [0, 0, 2, 3, 3, 1, 0, 3]
    accepted = [0, 0, 1, 3, 2, 0, 0, 3]
    p = replay.profile_from_positions(offered, accepted, max_k=3)
    assert p["offered_at_least"] == pytest.approx([5 / 8, 4 / 8, 3 / 8])
    # k=1: o>=1 at 5 positions, a>=1 at 4 of them; k=2: o>=2 & a>=1 at 4, a>=2 at 3; k=3: o>=3 & a>=2 at 3, a>=3 at 2
    assert p["accept_given"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert (p["offered"], p["accepted"], p["positions"]) == (12, 9, 8)
    with pytest.raises(ValueError):
        replay.profile_from_positions([1], [2])
    # near the end of a recording the room is smaller: those positions do not count against offering k
    q = replay.profile_from_positions([3, 3, 2, 1], [3, 3, 2, 1], max_k=3, rooms=[3, 3, 2, 1])
    assert q["offered_at_least"] == [1.0, 1.0, 1.0] and q["accept_given"] == [1.0, 1.0, 1.0]
    acc = replay.Acceptance.from_profile(p)
    draws = [acc.decide(1, j, 3) for j in range(4000)]
    assert abs(np.mean([o >= 1 for o, _ in draws]) - 5 / 8) < 0.03
    assert abs(np.mean([o >= 3 for o, _ in draws]) - 3 / 8) < 0.03
    first = [a >= 1 for o, a in draws if o >= 1]
    assert abs(np.mean(first) - 0.8) < 0.03


def test_lookup_and_draft_positions():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    ref = [1, 2, 3, 4, 5, 9]  # copies the prompt, then leaves it
    off, acc = replay.lookup_positions(prompt, ref)
    assert len(off) == len(ref) - 1
    # after "1 2 3" lookup proposes "4 5 6 7 8", capped by the room (3): 4, 5 accepted, 6 rejected
    assert off[:3] == [0, 0, 3] and acc[:3] == [0, 0, 2]
    assert all(a <= o for o, a in zip(off, acc))
    # draft: picks_after[i] is the draft's pick after position i of prompt + ref
    full = prompt + ref
    picks = np.array(full[1:] + [0])
    picks[len(prompt) + 2] = 0  # wrong after ref[2]
    off, acc = replay.draft_positions(picks, len(prompt), ref)
    assert off == [min(7, len(ref) - 1 - j) for j in range(len(ref) - 1)]
    assert acc == [2, 1, 0, 2, 1]


# ---- the replay proposer -------------------------------------------------------------------------------------------
def _book():
    book = replay.ReplayBook(vocab=50)
    ref = [0] + [int(x) for x in np.random.default_rng(0).integers(0, 50, 399)]
    book.add([7, 8, 9], ref, "w/0")
    book.add([7, 8, 9, 10], [1, 2, 3], "w/1")  # a longer prompt with the same start is told apart
    return book, ref


def test_replay_offers_the_reference():
    book, ref = _book()
    prop = replay.ReplayProposer(book, replay.Acceptance.fixed(1.0))
    prop.reset()
    h = [7, 8, 9] + ref[:5]
    assert prop.propose(h, 3) == ref[5:8]
    assert replay.ReplayProposer(book, replay.Acceptance.fixed(1.0)).propose([7, 8, 9, 10, 1], 2) == [2, 3]
    bad = replay.ReplayProposer(book, replay.Acceptance.fixed(0.0)).propose(h, 3)
    assert len(bad) == 3 and all(b != r for b, r in zip(bad, ref[5:8]))
    assert replay.ReplayProposer(book, replay.Acceptance.fixed(1.0)).propose([1, 2, 3, 4], 3) == []  # unknown prompt
    prop.propose([7, 8, 9] + ref[:4] + [ref[4] + 1], 3)  # history left the reference
    assert prop.diverged == 1
    assert prop.propose([7, 8, 9] + ref[:-1], 5) == [ref[-1]]  # no more than the reference holds


def test_replay_runs_its_cost_proposer_and_forwards_the_hooks():
    """The real proposer beside the replay (draft model on random weights) is asked, told, reset and bound; its
    proposals are discarded."""
    book, ref = _book()

    class Cost:
        def __init__(self):
            self.calls = []

        def propose(self, h, n, min_p=0.0):
            self.calls.append(("propose", len(h), n))
            return [999] * n

        def observe(self, kept):
            self.calls.append(("observe", list(kept)))

        def reset(self):
            self.calls.append(("reset",))

        def bind(self, slot):
            self.calls.append(("bind", slot))

    cost = Cost()
    prop = replay.ReplayProposer(book, replay.Acceptance.fixed(1.0), cost=cost)
    prop.reset()
    prop.bind(3)
    assert prop.propose([7, 8, 9] + ref[:2], 2) == ref[2:4]
    prop.observe(ref[2:5])
    assert cost.calls == [("reset",), ("bind", 3), ("propose", 5, 2), ("observe", ref[2:5])]
    assert prop.slot == 3 and prop.mtp_reads == 0


def test_replay_rate_and_determinism():
    book, ref = _book()
    for p in (0.62, 0.88):
        a = replay.ReplayProposer(book, replay.Acceptance.fixed(p))
        b = replay.ReplayProposer(book, replay.Acceptance.fixed(p))
        props_a = [a.propose([7, 8, 9] + ref[:j + 1], 1) for j in range(390)]
        props_b = [b.propose([7, 8, 9] + ref[:j + 1], 1) for j in range(390)]
        assert props_a == props_b
        hit = np.mean([pr[0] == ref[j + 1] for j, pr in enumerate(props_a)])
        assert abs(hit - p) < 0.07, (p, hit)
        assert a.offered == 390 and a.accepted_planned == sum(pr[0] == ref[j + 1] for j, pr in enumerate(props_a))


def _engine(engine_for):
    """The tiny qwen3next hybrid, split over 2 devices when there are 2 (the same engine as tests/test_slots.py)."""
    if not Path(HYBRID).exists():
        pytest.fail("committed hybrid fixture is missing (experiments/parity/make_hybrid_fixtures.py makes it)")
    if len(jax.devices()) >= 2:
        return engine_for(HYBRID, max_context=96, n_slots=2, layer_split="2", devices=jax.devices()[:2])
    return engine_for(HYBRID, max_context=96, n_slots=2)


@pytest.mark.slow
def test_replay_never_changes_the_output(engine_for):
    """Piped MTP on a 2-stage split (serial batch MTP with one device): replayed proposals at 60% are verified by
    the target, so every request's tokens are its solo tokens, and the kept proposals are exactly the planned ones."""
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.scheduler import BatchScheduler, Request
    from strata_jax.pipeline.solo import generate

    eng = _engine(engine_for)
    base = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]
    V = eng.cfg.vocab_size
    prompts = [[t % V for t in base[:10 + 2 * i] + base[:6]] for i in range(2)]
    reqs = [Request(p, max_new_tokens=6, sampling=SamplingParams(0.0), rid=f"t/{i}") for i, p in enumerate(prompts)]
    solo = {}
    for r in reqs:
        eng.reset_slot(0)
        solo[r.rid] = generate(eng, r.prompt_ids, max_new_tokens=r.max_new_tokens, sampling=r.sampling).tokens
    book = replay.ReplayBook(V)
    for r in reqs:
        book.add(r.prompt_ids, solo[r.rid], r.rid)
    if len(eng.stages) > 1:  # the same modes as tests/test_slots.py, so the compiled windows are shared
        modes = [("piped_mtp", dict(batch_groups=2, batch_groups_given=True, piped_mtp=2))]
    else:
        modes = [("batch_mtp", dict(batch_mtp=True))]
    made = []

    def factory():
        made.append(replay.ReplayProposer(book, replay.Acceptance.fixed(0.6)))
        return made[-1]

    for mode, flags in modes:
        res = resolve_groups(2, len(eng.stages), **flags)
        assert res.mode == mode, res.message
        made.clear()
        out = BatchScheduler(eng, res, proposer_factory=factory).run([copy.copy(r) for r in reqs])
        for r in out:
            assert r.tokens == solo[r.rid], (mode, r.rid)
        proposed, accepted = sum(r.proposed for r in out), sum(r.accepted for r in out)
        assert 0 < accepted < proposed, (mode, accepted, proposed)  # some kept, some rejected
        assert accepted == sum(p.accepted_planned for p in made)  # the verify kept exactly the planned ones
        assert all(p.diverged == 0 for p in made)


# ---- summary, goals, report ----------------------------------------------------------------------------------------
def _rec(w, s, arm, tok, rep=1, **kw):
    r = {"workload": w, "streams": s, "arm": arm, "total_tok_s": tok, "per_stream_tok_s": tok / s, "rep": rep,
         "label": "synthetic acceptance" if arm != "pipelined" else "", "proposed": 10, "accepted": 6,
         "windows_per_slot": 5, "stage_ms": [2.0, 3.0], "idle": [0.25, 0.5], "exact": True, "compiles": 0}
    r.update(kw)
    return r


def test_summary_medians_ratios_and_goals():
    recs = []
    for rep, (a, b, c) in enumerate([(100, 120, 150), (90, 130, 160), (300, 110, 140)], 1):  # medians 100/120/150
        recs += [_rec("code", 4, "pipelined", a, rep), _rec("code", 4, "batch_mtp", b, rep),
                 _rec("code", 4, "piped2", c, rep)]
    recs += [_rec("edit", 4, "pipelined", 100), _rec("edit", 4, "batch_mtp", 110), _rec("edit", 4, "piped2", 120),
             _rec("edit", 4, "piped1", 115)]
    recs += [_rec("code", 1, "piped2", 90, solo_ref="solo_rate2"), _rec("code", 1, "solo_rate2", 100),
             _rec("code", 4, "pipelined", 1.0, warmup=True)]
    rows = report.summarize(recs)
    by = {(r["workload"], r["streams"], r["arm"]): r for r in rows}
    code = by[("code", 4, "piped2")]
    assert code["total_tok_s"] == 150 and (code["total_min"], code["total_max"]) == (140, 160)
    assert code["reps"] == 3 and code["vs_pipelined"] == pytest.approx(1.5)
    assert code["vs_batch_mtp"] == pytest.approx(1.25) and code["kept"] == pytest.approx(0.6)
    assert code["stage_ms"] == [2.0, 3.0] and code["idle"] == [0.25, 0.5]
    assert by[("code", 1, "piped2")]["vs_solo"] == pytest.approx(0.9)
    goals = {(g["goal"], g["workload"], g["streams"]): g for g in report.compute_goals(rows)}
    g = goals[("piped drafting / pipelined default", "code", 4)]
    assert g["met"] and g["arm"] == "piped2" and g["target"] == 1.4
    g = goals[("piped drafting / pipelined default", "edit", 4)]  # best piped = piped2 at 1.2x, goal 1.3x
    assert g["met"] is False and g["measured"] == pytest.approx(1.2) and "missed by 0.10x" in g["note"]
    g = goals[("piped drafting / serial batch MTP", "edit", 4)]
    assert g["met"] is False and g["measured"] == pytest.approx(120 / 110)
    assert goals[("piped drafting / serial batch MTP", "code", 4)]["met"]
    g = goals[("one stream / solo path", "code", 1)]
    assert g["met"] is False and g["arm"] == "piped2 vs solo_rate2" and "10% below" in g["note"]
    md = report.markdown(rows, report.compute_goals(rows), {"model_set": "b", "model": "x", "smoke": True})
    assert "synthetic acceptance" in md and "CPU smoke run" in md
    assert "| 4 | piped2 | synthetic acceptance | 150.00 [140.00-160.00]" in md
    assert "**missed by 0.10x" in md and "| 1.25 |" in md and "25% / 50%" in md


def test_plot_writes_a_png(tmp_path):
    rows = report.summarize([_rec("code", 1, "pipelined", 10), _rec("code", 2, "pipelined", 18),
                         _rec("code", 2, "piped1", 25), _rec("prose", 2, "piped1", 20)])
    msg = report.plot(rows, str(tmp_path / "p.png"), "test")
    assert msg.startswith("wrote") and (tmp_path / "p.png").stat().st_size > 1000


# ---- workloads -----------------------------------------------------------------------------------------------------
def test_workloads_and_token_counts():
    assert workload.parse_tokens("600") == (600, 600) and workload.parse_tokens("300-900") == (300, 900)
    with pytest.raises(ValueError):
        workload.parse_tokens("900-300")
    assert [workload.tokens_for(i, 4, 300, 900) for i in range(4)] == [300, 500, 700, 900]
    assert workload.tokens_for(0, 1, 300, 900) == 600
    src = workload.edit_source()
    compile(src, "ledger.py", "exec")
    for old, new in workload.RENAMES:
        assert f"def {old}(self" in src and f".{old}(" in src and new not in src
    for w in workload.WORKLOADS:
        texts = workload.prompt_texts(w, 4)
        assert len(set(texts)) == 4  # each stream's prompt is its own (the replay book tells them apart)
    ids = workload.encode_prompts(None, ["ab"], 512)
    assert ids == [[97, 98]]
    arms = workload.make_arms(list(workload.ALL_ARMS), "rate", 3)
    assert [a.flags(4) for a in arms[:4]] == [{}, dict(batch_groups=1, batch_groups_given=True),
                                              dict(batch_mtp=True),
                                              dict(batch_groups=4, batch_groups_given=True, piped_mtp=1)]
    assert workload.solo_baseline(arms[5]).name == "solo_rate3" and workload.solo_baseline(arms[0]).name == "solo"
