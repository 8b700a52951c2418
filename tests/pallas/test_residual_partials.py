"""`STRATA_RESIDUAL_PARTIALS` on a dense model (issue 13 item 4: the residual add and norm behind a projection take
its GEMV's K splits): a tiny qwen2 file of fresh random Q4_K / Q6_K blocks (`strata_jax.testing.blocks`, written
with gguf-py), its stage on the kernel path in Pallas' interpreter. With the switch on, the window's program hands the attention output's and
the down projection's split partial sums to the norm kernels (``rows_add_partials_rms_norm``) and no longer holds
the XLA sums; the hidden rows and logits are the bits of the switch off, in a verify window and a prefill chunk.
With ``STRATA_NORM_PLANES=1`` the window's norms form the GEMVs' plane inputs (``rows_norm_planes``), within float32
rounding of the default."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from strata_jax.gguf.reader import open_gguf
from strata_jax.models import build_stage, config_from_gguf
from strata_jax.pallas import structure
from strata_jax.pallas.quant_matmul import gemv
from strata_jax.state import Rows

from pallas_testlib import random_weight

D, FF, HEADS, KV_HEADS, VOCAB, MC = 256, 512, 4, 2, 64, 32


def _write_qwen2(path, rng):
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(2)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(MC)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)

    def mat(name, n_out, n_in, qtype):
        w.add_tensor(name, np.asarray(random_weight(rng, qtype, n_out, n_in)), raw_dtype=qtype)

    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, D)).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, D).astype(np.float32))
    mat("output.weight", VOCAB, D, Q.Q6_K)
    hd = D // HEADS
    for i in range(2):
        p = f"blk.{i}."
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + n + ".weight", rng.uniform(0.5, 1.5, D).astype(np.float32))
        mat(p + "attn_q.weight", D, D, Q.Q4_K)
        mat(p + "attn_k.weight", KV_HEADS * hd, D, Q.Q4_K)
        mat(p + "attn_v.weight", KV_HEADS * hd, D, Q.Q6_K)
        for n, m in (("attn_q", D), ("attn_k", KV_HEADS * hd), ("attn_v", KV_HEADS * hd)):
            w.add_tensor(p + n + ".bias", (0.1 * rng.standard_normal(m)).astype(np.float32))
        mat(p + "attn_output.weight", D, D, Q.Q4_K)
        mat(p + "ffn_gate.weight", FF, D, Q.Q4_K)
        mat(p + "ffn_up.weight", FF, D, Q.Q4_K)
        mat(p + "ffn_down.weight", D, FF, Q.Q6_K if i else Q.Q4_K)   # the decoder path and the plane path
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("mode,T", [("window", 5), ("prefill", 5)],
                         ids=["window_10_rows_in_8_row_groups", "prefill"])
def test_residual_partials_same_bits(mode, T, tmp_path, rng, monkeypatch):
    path = tmp_path / "tiny_qwen2.gguf"
    _write_qwen2(path, rng)
    monkeypatch.setenv("STRATA_PALLAS_IMPL", "interpret")
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    g = open_gguf(str(path))
    cfg = config_from_gguf(g)
    stage = build_stage(g, cfg, 0, cfg.n_layer)
    assert gemv.tiling(Q.Q4_K, D, FF, gemv.choose_config(Q.Q4_K, D, FF))["split"] > 1   # the down's K splits
    toks = jnp.asarray(rng.integers(0, VOCAB, (2, T)).astype(np.int32))
    rows = Rows.make([0, 1], [4, 9], [T, T - 1])
    results, kernels = {}, {}
    settings = (("on", ("1", "0")), ("off", ("0", "0"))) + ((("planes", ("0", "1")),) if mode == "window" else ())
    for name, env in settings:
        monkeypatch.setenv("STRATA_RESIDUAL_PARTIALS", env[0])
        monkeypatch.setenv("STRATA_NORM_PLANES", env[1])
        jax.clear_caches()
        state = stage.init_state(2, MC)
        fn = lambda st, x: stage(st, x, rows, mode, MC)[0]   # noqa: E731
        jaxpr = jax.make_jaxpr(fn)(state, toks)
        kernels[name] = set(structure.jaxpr_report(jaxpr.jaxpr, [len(jax.tree.leaves(state)), 1]).kernels)
        results[name] = jax.tree.map(np.asarray, fn(state, toks))
    fused = {n for n in kernels["on"] if n.startswith("rows_add_partials")}
    if mode == "window":
        assert fused == {"rows_add_partials_rms_norm"}, sorted(kernels["on"])
        assert "rows_norm_planes" in kernels["planes"], sorted(kernels["planes"])
    else:
        assert not fused, "prefill rows take the GEMM: no partials"
    assert not {n for n in kernels["off"] if n.startswith("rows_add_partials")}
    for k in ("hidden", "logits"):
        np.testing.assert_array_equal(results["on"][k].view(np.uint32), results["off"][k].view(np.uint32), k)
        if "planes" in results:   # the norm's launch forms the 16-value sums with its own contractions
            np.testing.assert_allclose(results["planes"][k], results["on"][k], rtol=2e-5,
                                       atol=2e-5 * float(np.abs(results["on"][k]).max()), err_msg=k)
    assert np.isfinite(results["on"]["logits"]).all()


def test_hybrid_mixer_partials_same_bits(monkeypatch):
    """The hybrid blocks (qwen35 fixture: GDN and gated attention): the mixer's output projection hands its K
    splits to the FFN norm (``rows_add_partials_rms_norm`` in a window: once per layer whose projection takes the
    float32 GEMV, 3 of the fixture's 4), the window's hidden rows
    and logits the bits of the switch off."""
    from pathlib import Path
    fix = Path(__file__).resolve().parents[1] / "fixtures" / "hybrid" / "qwen35_q8_0.gguf"
    if not fix.exists():
        pytest.fail(f"committed fixture {fix.name} is missing (experiments/parity/make_hybrid_fixtures.py makes it)")
    monkeypatch.setenv("STRATA_PALLAS_IMPL", "interpret")
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    g = open_gguf(str(fix))
    cfg = config_from_gguf(g)
    stage = build_stage(g, cfg, 0, cfg.n_layer)
    rng = np.random.default_rng(5)
    toks = jnp.asarray(rng.integers(0, 64, (3, 4)).astype(np.int32))
    rows = Rows.make([0, 1, 2], [4, 9, 2], [4, 3, 4])
    out = {}
    for on in ("1", "0"):
        monkeypatch.setenv("STRATA_RESIDUAL_PARTIALS", on)
        jax.clear_caches()
        state = stage.init_state(3, MC)
        fn = lambda st, x: stage(st, x, rows, "window", MC)[0]   # noqa: E731
        n = str(jax.make_jaxpr(fn)(state, toks)).count("rows_add_partials_rms_norm")
        assert (0 < n <= cfg.n_layer) if on == "1" else n == 0, (on, n, cfg.n_layer)
        out[on] = jax.tree.map(np.asarray, fn(state, toks))
    for k in out["1"]:
        np.testing.assert_array_equal(out["1"][k].view(np.uint32), out["0"][k].view(np.uint32), k)
