"""The families qwen35 (Qwen3.5 dense hybrid), qwen3 (dense, q/k norms) and qwen3moe (MoE, no shared expert) against
HF transformers, through the engine as a user runs them.

Fixtures (``tests/fixtures/hybrid/``, made by ``experiments/parity/make_hybrid_fixtures.py --families
qwen35,qwen3,qwen3moe``: tiny random HF models converted by llama.cpp's converter): ``<family>_f32.gguf``,
``<family>_q8_0.gguf`` and ``<family>_ref.npz`` with the layout of the other hybrid fixtures (``prompt_ids`` [64],
``prefill_logits`` [64, V], ``step_ids`` / ``step_logits`` [24] of HF's cached greedy decode, ``oracle_q8_*`` = HF on
the dequantized Q8_0 weights). qwen35's f32 file carries the MTP block the converter exported from the checkpoint's
``mtp.*`` tensors (its q8_0 file was converted with ``--no-mtp``), and its npz ``mtp_logits`` [87, V]: the MTP block
built from HF's own modules over prompt + step_ids (cell i: the trunk's post-final-norm hidden at i and token i+1).

Per family: f32 prefill and the 24 decode steps within 1e-4 (relative to the largest logit) of HF and the same greedy
ids; Q8_0 within 1e-3 of the oracle with the oracle's greedy ids; a T=4 verify window gives the bits of the four T=1
steps, and after a rejection (commit of the 2 kept rows) decoding continues with the bits of the plain decode.
qwen35 also: its MTP block against the HF-built reference, and ``--draft mtp`` decoding equal to the plain decode.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from strata_jax.errors import StrataError
from strata_jax.models.registry import mtp_head
from strata_jax.pipeline.solo import generate
from strata_jax.proposers import make_proposer
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows

CTX = 96  # the shared engines' context (tests/conftest.py); 64 prompt + 25 decoded tokens fit
FIX = Path(__file__).parent / "fixtures" / "hybrid"
FAMILIES = ("qwen35", "qwen3", "qwen3moe")
GREEDY = SamplingParams(0.0)
N = 24  # HF decode steps in the fixtures


def _path(family: str, quant: str) -> str:
    p = FIX / f"{family}_{quant}.gguf"
    if not p.exists():
        pytest.fail(f"committed fixture {p.name} is missing (experiments/parity/make_hybrid_fixtures.py makes it)")
    return str(p)


@functools.lru_cache(maxsize=None)
def _ref(family: str) -> dict:
    return dict(np.load(FIX / f"{family}_ref.npz"))


def _rel(a, ref) -> float:
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def _check(gen, prefill, steps, ids, tol):
    """The engine's plain decode against a reference: ``gen.step_logits[i + 1]`` is the output of feeding step i's
    token (row 0 is the prompt's last row)."""
    assert _rel(gen.prefill_logits, prefill) < tol
    for i in range(N):
        assert _rel(gen.step_logits[i + 1], steps[i]) < tol, f"step {i}"
    assert gen.tokens[:N] == ids.tolist()
    assert gen.tokens[N] == int(np.argmax(steps[N - 1]))


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_matches_hf(family, engine_for, plain_decode):
    ref = _ref(family)
    eng = engine_for(_path(family, "f32"), max_context=CTX)
    assert eng.cfg.arch == family
    gen = plain_decode(eng, ref["prompt_ids"], N + 1)
    _check(gen, ref["prefill_logits"], ref["step_logits"], ref["step_ids"], 1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_matches_oracle(family, engine_for, plain_decode):
    ref = _ref(family)
    eng = engine_for(_path(family, "q8_0"), max_context=CTX)
    gen = plain_decode(eng, ref["prompt_ids"], N + 1)
    _check(gen, ref["oracle_q8_prefill_logits"], ref["oracle_q8_step_logits"], ref["oracle_q8_step_ids"], 1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_window_exact_and_commit(family, engine_for, plain_decode):
    """A T=4 window of the greedy ids gives the bits of the plain decode's four T=1 steps, every proposal kept; a
    window whose third token is wrong keeps 2 rows, and after its commit T=1 windows continue with the bits of the
    plain decode (the GDN state of qwen35 advanced by exactly the kept rows)."""
    ref = _ref(family)
    eng = engine_for(_path(family, "f32"), max_context=CTX)
    prompt = ref["prompt_ids"].tolist()
    P = len(prompt)
    plain = plain_decode(eng, prompt, N + 1)
    ids = plain.tokens
    samp = RowSampling.make([GREEDY])

    eng.prefill(0, prompt, GREEDY)
    res = eng.window(np.array([ids[:4]], np.int32), Rows.make([0], [P], [4]), samp)
    logits = np.asarray(res.device_out["logits"][0])
    for t in range(4):
        np.testing.assert_array_equal(logits[t], plain.step_logits[t + 1])
    assert res.picks[0].tolist() == ids[1:5] and int(res.n_keep[0]) == 4

    eng.prefill(0, prompt, GREEDY)
    wrong = (ids[2] + 1) % eng.cfg.vocab_size
    rows = Rows.make([0], [P], [4])
    res = eng.window(np.array([[ids[0], ids[1], wrong, ids[3]]], np.int32), rows, samp)
    assert int(res.n_keep[0]) == 2 and res.picks[0, :2].tolist() == ids[1:3]
    eng.commit(rows, res.pending, res.n_keep)
    for i in range(2, 5):  # feed ids[i] at position P + i
        rows = Rows.make([0], [P + i], [1])
        res = eng.window(np.array([[ids[i]]], np.int32), rows, samp)
        np.testing.assert_array_equal(np.asarray(res.device_out["logits"][0, 0]), plain.step_logits[i + 1])
        assert int(res.n_keep[0]) == 1
        eng.commit(rows, res.pending, res.n_keep)


def test_qwen35_mtp_block_matches_hf_reference(engine_for, plain_decode):
    """The converter-exported MTP block (dense FFN) against HF's modules over prompt + greedy steps (prefill of the
    first 84 cells, then a window of the last 3), that window equal to three T=1 windows bit for bit. The
    trunk's hidden rows come from the shared engine's prefill (the chunk shape its plain decode compiled)."""
    from strata_jax.pipeline.engine import PREFILL_CHUNK

    ref = _ref("qwen35")
    eng = engine_for(_path("qwen35", "f32"), max_context=CTX)
    g, cfg = eng.gguf, eng.cfg
    assert cfg.n_nextn == 1 and cfg.n_expert == 0 and cfg.n_layer == 4
    seq = np.concatenate([ref["prompt_ids"], ref["step_ids"]]).astype(np.int32)
    S = len(seq)  # 88: MTP cells 0..86 (hidden i, token i + 1)
    plain_decode(eng, ref["prompt_ids"], N + 1)  # compiles the prefill chunk (shared with test_f32_matches_hf)
    toks = np.zeros((1, PREFILL_CHUNK), np.int32)
    toks[0, :S] = seq
    eng.reset_slot(0)  # a new sequence: GDN state from zero (Engine.prefill does this; run does not)
    out, _ = eng.run("prefill", toks, Rows.make([0], [0], [S]), RowSampling.make([GREEDY]), logits="all")
    h = out["mtp_hidden"][:, :S]
    head = mtp_head(g, cfg)
    hgd, hparams = nnx.split(head)
    draft = jax.jit(lambda p, st, hh, t, r, mode: nnx.merge(hgd, p).draft(st, hh, t, r, mode),
                    static_argnames=("mode",))
    toks = jnp.asarray(seq[None, 1:])
    n_cells, split = S - 1, S - 4  # prefill cells 0..83, then a T=3 window over cells 84..86
    lg0, _, st = draft(hparams, head.init_state(1, CTX), h[:, :split], toks[:, :split], Rows.make([0], [0], [split]),
                       mode="prefill")
    lg1, h1s, _ = draft(hparams, st, h[:, split:n_cells], toks[:, split:], Rows.make([0], [split], [3]),
                        mode="window")
    ours = np.concatenate([np.asarray(lg0[0]), np.asarray(lg1[0])])
    assert ours.shape == ref["mtp_logits"].shape
    assert _rel(ours, ref["mtp_logits"]) < 1e-4
    # the T=3 window's rows are the bits of three T=1 windows (each writes the K/V cell the next one reads)
    for i in range(3):
        p = split + i
        l1, h1, st = draft(hparams, st, h[:, p:p + 1], toks[:, p:p + 1], Rows.make([0], [p], [1]), mode="window")
        np.testing.assert_array_equal(np.asarray(l1[0, 0]), np.asarray(lg1[0, i]))
        np.testing.assert_array_equal(np.asarray(h1[0, 0]), np.asarray(h1s[0, i]))


def test_qwen35_mtp_drafts_are_exact(engine_for, plain_decode):
    """``--draft mtp`` on the qwen35 file with the exported MTP block decodes token for token what the plain decode
    gives (greedy and seeded); the q8_0 file, converted without it, has no MTP layer."""
    ref = _ref("qwen35")
    eng = engine_for(_path("qwen35", "f32"), max_context=CTX)
    prompt = ref["prompt_ids"].tolist()
    plain = plain_decode(eng, prompt, N + 1)
    seeded = SamplingParams(0.7, 20, 1.0, 0.0, 5)
    plain_seeded = plain_decode(eng, prompt, 16, seeded)
    prop = make_proposer("mtp", eng, spec=4)
    try:
        spec = generate(eng, prompt, max_new_tokens=N + 1, sampling=GREEDY, proposer=prop, spec=4)
        assert spec.tokens == plain.tokens[:N + 1]
        assert spec.stats.proposer == "mtp" and spec.stats.proposed > 0
        spec = generate(eng, prompt, max_new_tokens=16, sampling=seeded, proposer=prop, spec=4)
        assert spec.tokens == plain_seeded.tokens[:16]
    finally:
        eng.set_mtp_chain(0)  # the shared engine: later tests decode without the chain
    small = engine_for(_path("qwen35", "q8_0"), max_context=CTX)
    assert small.cfg.n_nextn == 0
    with pytest.raises(StrataError, match="no MTP layer"):
        small.enable_mtp(1)


def test_qwen3_drafts_for_qwen3moe(engine_for, plain_decode):
    """The dense qwen3 fixture (same tokenizer) as the draft model of the qwen3moe fixture: speculative decoding
    gives the plain decode's tokens. Both engines are the shared ones of the tests above (their window, step and
    prefill shapes are compiled already)."""
    from strata_jax.proposers import DraftModelProposer

    ref = _ref("qwen3moe")
    target = engine_for(_path("qwen3moe", "f32"), max_context=CTX)
    draft = engine_for(_path("qwen3", "f32"), max_context=CTX)
    prompt = ref["prompt_ids"].tolist()
    plain = plain_decode(target, prompt, N + 1)
    # target=None: no tokenizer comparison (the fixtures' placeholder gpt2 vocab t0..t511 with the merge "t 0" is
    # refused by the tokenizers library; both files hold the same 512 token strings)
    assert draft.gguf.metadata["tokenizer.ggml.tokens"] == target.gguf.metadata["tokenizer.ggml.tokens"]
    prop = DraftModelProposer(draft, None, window=4)
    spec = generate(target, prompt, max_new_tokens=N + 1, sampling=GREEDY, proposer=prop, spec=4)
    assert spec.tokens == plain.tokens[:N + 1]
    assert spec.stats.proposer == "model" and spec.stats.proposed > 0
