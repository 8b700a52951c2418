"""MTP proposals on whole models (`strata_jax.proposers.mtp`, `strata_jax.pipeline.mtp_chain`): the tiny hybrid
fixtures with an MTP block appended (`strata_jax.testing.mtp_block`; the MTP weights are random, so few drafts are
accepted).

* Speculative solo decoding with ``--draft mtp`` gives token for token the plain output (greedy and seeded, with
  and without ``--spec_min_p``), for qwen35moe and qwen4exp.
* The drafts waiting after a window are the MTP chain over the sequence's history: re-reading the history as a
  prompt (prefill-mode MTP over every row) yields the same drafts and probabilities (1e-4) as the window-by-window
  catch-up, with windows kept whole (an oracle supplies the proposals while the MTP chain runs).
* Batch modes with MTP proposals (batch MTP in serial windows, piped MTP, and the MTP chain beside serial and
  pipelined windows) on a 2-stage split: every request decodes its solo tokens (qwen4exp's decoded alone on the
  one-device engine).
"""

from pathlib import Path

import jax
import numpy as np
import pytest

from strata_jax.errors import StrataError
from strata_jax.pipeline.engine import Engine
from strata_jax.pipeline.groups import resolve_groups
from strata_jax.pipeline.solo import generate
from strata_jax.proposers import MtpProposer, ScriptedProposer, make_proposer
from strata_jax.sampling import SamplingParams
from strata_jax.testing import exactness as bx
from strata_jax.testing.mtp_block import add_mtp_block

ROOT = Path(__file__).parents[1]
CTX = 96
SEEDED = SamplingParams(0.7, 20, 1.0, 0.0, 5)
_ENGINES = {}


def _mtp_file(tmp_path_factory, arch: str) -> str:
    src = ROOT / "tests" / "fixtures" / "hybrid" / f"{arch}_q8_0.gguf"
    if not src.exists():
        pytest.fail(f"committed fixture {src.name} is missing (experiments/parity/make_hybrid_fixtures.py makes it)")
    dst = tmp_path_factory.getbasetemp() / f"{arch}_mtp.gguf"
    if not dst.exists():
        add_mtp_block(str(src), str(dst), seed=1)
    return str(dst)


def _engine(tmp_path_factory, arch, n_slots=1, split=None):
    key = (arch, n_slots, split)
    if key not in _ENGINES:
        devs = jax.devices()[:2] if split else None
        _ENGINES[key] = Engine(_mtp_file(tmp_path_factory, arch), max_context=CTX, n_slots=n_slots,
                               layer_split=split, devices=devs)
    return _ENGINES[key]


def _prompt(eng, n=21, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, eng.cfg.vocab_size, n)]


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen4exp"])
def test_mtp_speculative_equals_plain(tmp_path_factory, arch):
    eng = _engine(tmp_path_factory, arch)
    assert eng.cfg.n_nextn == 1
    prompt = _prompt(eng)
    prop = make_proposer("mtp", eng, spec=4)
    assert isinstance(prop, MtpProposer) and eng.mtp.n_draft == 3
    for samp, min_p in [(SamplingParams(0.0), 0.0), (SEEDED, 0.05)]:
        plain = generate(eng, prompt, max_new_tokens=20, sampling=samp)
        spec = generate(eng, prompt, max_new_tokens=20, sampling=samp, proposer=prop, spec=4, spec_min_p=min_p)
        assert spec.tokens == plain.tokens, (arch, samp)
        assert spec.stats.proposer == "mtp" and spec.stats.windows > 0
        if min_p == 0.0:
            assert spec.stats.proposed >= 3 * (spec.stats.windows - 2)  # every window carried the full chain


def test_mtp_drafts_follow_history(tmp_path_factory):
    """After windows kept whole (n_keep up to 4), the waiting drafts equal a fresh read of the history."""
    eng = _engine(tmp_path_factory, "qwen4exp")
    prompt = _prompt(eng, seed=3)
    ref = generate(eng, prompt, max_new_tokens=18).tokens
    mtp = MtpProposer(eng, n_draft=3)
    seen = []

    def oracle(h, n):
        seen.append((list(h), mtp.propose(h, 3)[:], list(mtp.last_probs or [])))
        done = len(h) - len(prompt)
        return ref[done:done + n]

    g = generate(eng, prompt, max_new_tokens=18, proposer=ScriptedProposer(oracle, "oracle"), spec=4)
    assert g.tokens == ref and g.stats.accepted == g.stats.proposed > 0
    assert g.stats.window_tokens.get(4, 0) >= 2  # windows with all three proposals kept
    checked = 0
    for hist, drafts, probs in seen[1:]:
        assert len(drafts) == 3, "the drafts waiting after each window follow the history"
        pick, _ = eng.prefill(0, hist[:-1], SamplingParams(0.0))
        assert pick == hist[-1]
        pos, d2, p2 = eng.mtp.proposal(0)
        assert pos == len(hist) - 1
        assert d2 == drafts
        np.testing.assert_allclose(p2, probs, rtol=1e-4)
        checked += 1
    assert checked >= 3


def test_mtp_refusals(tmp_path_factory):
    plain = Engine(str(ROOT / "tests" / "fixtures" / "hybrid" / "qwen3next_q8_0.gguf"), max_context=32)
    with pytest.raises(StrataError, match="no MTP layer"):
        make_proposer("mtp", plain)
    with pytest.raises(StrataError, match="no MTP layer"):
        plain.mtp.enable(2)
    assert plain.mtp.set_chain(3) == 0 and not plain.mtp.active  # no MTP layer: nothing runs
    eng = _engine(tmp_path_factory, "qwen35moe")
    with pytest.raises(StrataError, match="1..7"):
        eng.mtp.enable(8)
    with pytest.raises(StrataError, match="0..7"):
        eng.mtp.set_chain(8)


def test_set_mtp_chain_pauses_and_resumes(tmp_path_factory):
    """``mtp.set_chain(0)`` stops the chain (no drafts are made while paused), ``mtp.set_chain(3)`` brings it back."""
    eng = _engine(tmp_path_factory, "qwen35moe")
    assert eng.mtp.set_chain(3) == 3 and eng.mtp.active and eng.mtp.n_draft == 3
    # the MTP layer shares the trunk's head and embedding buffers on this device (no second copy)
    trunk = eng.stages[-1].module
    assert eng.mtp.layer.head.w[...] is trunk.head.w[...] and eng.mtp.layer.embed.w[...] is trunk.embed.w[...]
    a, b = _prompt(eng, seed=7), _prompt(eng, seed=8)
    generate(eng, a, max_new_tokens=4)
    pos, drafts, _ = eng.mtp.proposal(0)
    assert pos == len(a) + 4 - 1 and len(drafts) == 3  # the drafts follow the 4th new token (history end)
    assert eng.mtp.set_chain(0) == 0 and not eng.mtp.active
    generate(eng, b, max_new_tokens=4)
    assert eng.mtp.proposal(0) == (pos, drafts, eng.mtp.proposal(0)[2])  # untouched while paused
    assert eng.mtp.set_chain(3) == 3
    generate(eng, b, max_new_tokens=4)
    assert eng.mtp.proposal(0)[0] == len(b) + 4 - 1


# qwen4exp (PLE, QSA, hyper-connections) in every mode that carries MTP proposals; qwen3next in piped MTP (the
# deferred commit of the kept rows on every stage), the mode this project exists for
CASES = [("qwen4exp", "batch_mtp"), ("qwen4exp", "piped_mtp"), ("qwen4exp", "pipelined"), ("qwen3next", "piped_mtp")]
_SOLO: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("arch,mode", CASES, ids=[f"{a}-{m}" for a, m in CASES])
def test_mtp_batch_modes_exact(tmp_path_factory, arch, mode):
    """One workload mixing greedy and seeded requests (request 0 greedy, 1 seeded and cancelled, 2 seeded), so
    greedy and sampled rows share windows; every request decodes its solo tokens."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    eng = _engine(tmp_path_factory, arch, n_slots=2, split="2")
    factory = lambda: make_proposer("mtp", eng, spec=3)  # noqa: E731
    prompts = [_prompt(eng, 12 + 2 * i, seed=10 + i) for i in range(3)]
    reqs = bx.workload(prompts, 8, sampled=True)
    reqs[0].sampling = bx.GREEDY
    if arch not in _SOLO:
        # qwen4exp's solo references come from the file's one-device engine (same MTP file), whose solo programs the
        # tests above compiled already (a split gives the one-device tokens: tests/test_split.py); qwen3next has
        # no such engine here, so its solo references decode on the split engine itself
        solo_eng = _engine(tmp_path_factory, arch) if arch == "qwen4exp" else eng
        _SOLO[arch] = {i: bx.solo_tokens(solo_eng, r) for i, r in enumerate(reqs)}
    kw = {"batch_mtp": dict(batch_mtp=True), "piped_mtp": dict(piped_mtp=2), "pipelined": {}}[mode]
    res = resolve_groups(eng.n_slots, len(eng.stages), **kw)
    assert res.mode == mode, res.message
    results, bad, sch = bx.check(eng, res, reqs, _SOLO[arch], factory)
    assert not bad, (arch, mode, bad)
    # drains only for admissions, the cancellation and returns to solo (not every tick)
    assert sch.stats["drains"] <= len(reqs) + 3, (mode, sch.stats)
    if mode != "pipelined":
        assert sum(r.proposed for r in results) > 0, mode
