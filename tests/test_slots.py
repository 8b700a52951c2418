"""Batch slots are exact: every request decodes the tokens it decodes alone, in every batch mode
(serial windows, pipelined groups, batch proposals, piped proposals), greedy and seeded (temperature 0.7, top_k 20, a
seed per request), with staggered admissions, a cancellation and slot reuse (more requests than slots), on 2 and 4
CPU host devices, for SmolLM2 and the tiny qwen3next hybrid (proposals: prompt lookup).

Each workload mixes greedy and seeded requests (request 0 greedy, 1 seeded and cancelled, 2 seeded, 3 greedy, ...),
so greedy and seeded rows share windows, and one run per mode checks both kinds.

The workload and the comparison live in `strata_jax.testing.exactness`. Engines are shared with tests/test_split.py
(same keys), so compiled functions are reused; the solo references are computed once per model (on its first
engine: the 4-stage tests reuse the 2-stage engine's).
"""

from pathlib import Path

import jax
import pytest

from strata_jax.pipeline.groups import resolve_groups
from strata_jax.proposers import ScriptedProposer
from strata_jax.testing import exactness as bx

HYBRID = str(Path(__file__).parent / "fixtures" / "hybrid" / "qwen3next_f32.gguf")
CTX = 96
BASE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]
MODE_FLAGS = {"serial": dict(batch_groups=1, batch_groups_given=True), "pipelined": {},
              "batch_mtp": dict(batch_mtp=True), "piped_mtp": dict(piped_mtp=2)}


def _engine(engine_for, name, k):
    if name == HYBRID and not Path(HYBRID).exists():
        pytest.fail("committed hybrid fixture is missing (experiments/parity/make_hybrid_fixtures.py makes it)")
    if len(jax.devices()) < k:
        pytest.skip(f"needs {k} devices (XLA_FLAGS=--xla_force_host_platform_device_count={k})")
    split = {("smollm2-135m", 2): "15", ("smollm2-135m", 4): "8,15,23", (HYBRID, 2): "2", (HYBRID, 4): "1,2,3"}
    return engine_for(name, max_context=CTX, n_slots=k if k > 2 else 2, layer_split=split[(name, k)],
                      devices=jax.devices()[:k])


def _prompts(eng, n):
    V = eng.cfg.vocab_size
    return [[t % V for t in BASE[:10 + 2 * i] + BASE[:6]] for i in range(n)]  # repeats: lookup proposes


_SOLO: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_solo():
    """The references hold their engine: let it go with the file (conftest may release the shared engines)."""
    yield
    _SOLO.clear()


def _workload(eng, n_new):
    """n_slots + 1 requests one round apart (request 1 cancelled): greedy for requests 0 and 3, seeded otherwise."""
    reqs = bx.workload(_prompts(eng, eng.n_slots + 1), n_new, sampled=True)
    for i in (0, 3):
        if i < len(reqs):
            reqs[i].sampling = bx.GREEDY
    assert {r.sampling.greedy for r in reqs if r.cancel_round is None} == {True, False}
    return reqs


def _solo(name, eng, reqs, n_new):
    """The requests decoded alone, computed once per model and shared by its engines' tests: request i is the same
    on every split (prompt i, sampler i), and a split decodes the one-device tokens (tests/test_split.py), so the
    4-stage tests reuse the 2-stage engine's references and decode alone only the requests it lacked (on the engine
    that first needed them, whose solo programs the earlier test compiled)."""
    if (name, n_new) not in _SOLO:
        _SOLO[name, n_new] = (eng, {})
    solo_eng, solo = _SOLO[name, n_new]
    for i, r in enumerate(reqs):
        if i not in solo:
            solo[i] = bx.solo_tokens(solo_eng, r)
    return {i: solo[i] for i in range(len(reqs))}


def _check_modes(name, eng, modes, n_new=8, proposer_factory=None):
    reqs = _workload(eng, n_new)
    solo = _solo(name, eng, reqs, n_new)
    for mode in modes:
        res = resolve_groups(eng.n_slots, len(eng.stages), **MODE_FLAGS[mode])
        assert res.mode == mode, res.message
        results, bad, sch = bx.check(eng, res, reqs, solo, proposer_factory)
        assert not bad, (mode, bad)
        reasons = [r.stop_reason for r in results]
        assert reasons[1] == "cancelled" and reasons.count("max tokens") == len(reqs) - 1, (mode, reasons)
        assert sch.stats["windows"] > 0, mode
        if mode in ("pipelined", "piped_mtp"):
            assert sch.stats["drains"] > 0, mode  # admissions drained the pipeline
        # slot reuse: more requests than slots, every request got a slot
        assert len({r.slot for r in results}) <= eng.n_slots and all(r.slot >= 0 for r in results)


def _echo_factory(eng):
    """A proposer that guesses the previous token again (often wrong): exercises rejected rows and partial keeps."""
    return lambda: ScriptedProposer(lambda h, n: [h[-1]] * n, "echo")


@pytest.mark.slow
def test_smollm2_two_stages_every_mode(engine_for):
    eng = _engine(engine_for, "smollm2-135m", 2)
    _check_modes("smollm2-135m", eng, ["serial", "pipelined", "batch_mtp", "piped_mtp"])


@pytest.mark.slow
def test_smollm2_two_stages_rejected_proposals(engine_for):
    eng = _engine(engine_for, "smollm2-135m", 2)
    _check_modes("smollm2-135m", eng, ["batch_mtp", "piped_mtp"], proposer_factory=_echo_factory(eng))


@pytest.mark.slow
def test_hybrid_two_stages(engine_for):
    eng = _engine(engine_for, HYBRID, 2)
    _check_modes(HYBRID, eng, ["serial", "pipelined", "piped_mtp"])


@pytest.mark.slow
def test_smollm2_four_stages_pipelined(engine_for):
    eng = _engine(engine_for, "smollm2-135m", 4)
    _check_modes("smollm2-135m", eng, ["pipelined", "piped_mtp"])


@pytest.mark.slow
def test_hybrid_four_stages_pipelined(engine_for):
    eng = _engine(engine_for, HYBRID, 4)
    _check_modes(HYBRID, eng, ["pipelined"])
