"""qmatmul: reference and kernel (interpret mode) against float64, row independence (the GEMV at M = 1..8 and in
8-row groups, the prefill GEMM at any M), ragged K splits, small float K, the in-kernel block decoders against
strata_jax.gguf.blocks, errors and the auto rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q

from strata_jax.errors import UnsupportedError
from strata_jax.gguf.blocks import dequantize
from strata_jax.pallas import dispatch
from strata_jax.pallas.quant_matmul import qmatmul
from strata_jax.pallas.quant_matmul.formats import decode_rows_jnp

from pallas_testlib import IMPLS, assert_bits_equal, random_weight

N_OUT = 20   # not a multiple of the kernel's 16-row tile: the last tile is partial
K_IN = 512


def f64_bound(x, w):
    """(x @ w.T in float64, |x| @ |w|.T): the elementwise error scale of a float32 dot product."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    w = np.asarray(w, np.float64)
    return x @ w.T, np.abs(x) @ np.abs(w).T


def check_rel(got, want, scale, rtol, what):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (unwritten / poisoned element?)"
    rel = np.max(np.abs(got - want) / scale)
    assert rel <= rtol, f"{what}: max error / (|x|@|w|) = {rel:.3g} > {rtol}"


@pytest.mark.parametrize("qtype", [Q.Q5_1, Q.Q3_K, Q.Q6_K], ids=lambda q: q.name)  # the rest: via accuracy
def test_kernel_decoders_match_blocks(qtype, rng):
    raw = random_weight(rng, qtype, 5, 512)
    got = jax.jit(decode_rows_jnp, static_argnums=(1, 2))(jnp.asarray(raw), qtype, 512)
    assert_bits_equal(got, np.asarray(dequantize(raw, qtype, 512)), f"{qtype.name} decode")


KERNEL_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F32, Q.F16, Q.BF16]


# the reference is blocks.dequantize (tested in tests/test_blocks.py) + one dot: a few formats suffice for it
CASES = ([("interpret", q) for q in KERNEL_TYPES] + [("reference", q) for q in (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F16)]
         + [("kernel", q) for q in KERNEL_TYPES if "kernel" in IMPLS])


@pytest.mark.parametrize("impl,qtype", CASES, ids=lambda a: getattr(a, "name", a))
def test_qmatmul_accuracy_f32(impl, qtype, rng):
    w_raw = random_weight(rng, qtype, N_OUT, K_IN)
    x = rng.standard_normal((3, K_IN)).astype(np.float32)
    with dispatch.poison_outputs():
        y = qmatmul(jnp.asarray(x), jnp.asarray(w_raw), qtype, N_OUT, K_IN, impl=impl)
    assert y.dtype == jnp.float32 and y.shape == (3, N_OUT)
    want, scale = f64_bound(x, np.asarray(dequantize(w_raw, qtype, K_IN)))
    check_rel(y, want, scale, 1e-5, f"{impl} {qtype.name}")


@pytest.mark.parametrize("impl", IMPLS)
def test_qmatmul_bf16_operands(impl, rng):
    w32 = rng.standard_normal((N_OUT, K_IN)).astype(np.float32) * 0.1
    x32 = rng.standard_normal((4, K_IN)).astype(np.float32)
    y = qmatmul(jnp.asarray(x32, jnp.bfloat16), jnp.asarray(w32, jnp.bfloat16), Q.BF16, N_OUT, K_IN, impl=impl)
    want, scale = f64_bound(x32, w32)  # float64 of the unrounded operands
    check_rel(y, want, scale, 1e-2, f"{impl} bf16")


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_independent(impl, rng):
    """Row m of an M-row call == the row alone (M = 1), bit for bit, whatever the other rows hold; M > 8 with row
    groups (the kernel runs 8-row groups)."""
    qtype = Q.Q4_K
    w = jnp.asarray(random_weight(rng, qtype, N_OUT, K_IN))
    ms = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24]
    X = jnp.asarray(rng.standard_normal((max(ms), K_IN)).astype(np.float32))
    if impl == "interpret":
        ms = [3, 8, 12]  # each M compiles its own interpreted kernel: keep CI short
    alone = np.stack([np.asarray(qmatmul(X[i:i + 1], w, qtype, N_OUT, K_IN, impl=impl))[0]
                      for i in range(max(ms))])
    for M in ms:
        Y = qmatmul(X[:M], w, qtype, N_OUT, K_IN, impl=impl, row_groups=True)
        assert_bits_equal(Y, alone[:M], f"M={M} vs rows alone")
    # other rows' contents do not matter
    X2 = X.at[1:].set(jnp.asarray(rng.standard_normal((X.shape[0] - 1, K_IN)).astype(np.float32)) * 100)
    Y2 = qmatmul(X2[:ms[-1]], w, qtype, N_OUT, K_IN, impl=impl, row_groups=True)
    assert_bits_equal(Y2[0], alone[0], "row 0 with other neighbours")


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "reference"])
def test_single_tile_rows_independent(impl, rng):
    """A weight of one output tile and one K split (a grid of one program for one row): alone vs in 8-row groups."""
    w = jnp.asarray(random_weight(rng, Q.Q8_0, 6, 256))
    X = jnp.asarray(rng.standard_normal((12, 256)).astype(np.float32))
    Y = qmatmul(X, w, Q.Q8_0, 6, 256, impl=impl, row_groups=True)
    for i in (0, 11):
        assert_bits_equal(qmatmul(X[i:i + 1], w, Q.Q8_0, 6, 256, impl=impl)[0], Y[i], f"row {i} alone")


def test_errors_and_auto(rng):
    w = jnp.asarray(random_weight(rng, Q.Q8_0, N_OUT, K_IN))
    x = jnp.asarray(rng.standard_normal((2, K_IN)).astype(np.float32))
    with pytest.raises(UnsupportedError):
        qmatmul(x[:, :256], w, Q.Q8_0, N_OUT, K_IN)
    with pytest.raises(UnsupportedError):
        qmatmul(x, w[:, :-2], Q.Q8_0, N_OUT, K_IN)
    with pytest.raises(UnsupportedError):
        qmatmul(x, w, Q.Q8_0, N_OUT, K_IN, impl="nope")
    x9 = jnp.asarray(rng.standard_normal((9, K_IN)).astype(np.float32))
    assert qmatmul(x9, w, Q.Q8_0, N_OUT, K_IN).shape == (9, N_OUT)  # auto on a CPU: the reference
    iq = jnp.asarray(random_weight(rng, Q.IQ4_NL, N_OUT, K_IN))
    with pytest.raises(UnsupportedError):
        qmatmul(x, iq, Q.IQ4_NL, N_OUT, K_IN, impl="interpret")  # no kernel for IQ formats yet
    assert qmatmul(x, iq, Q.IQ4_NL, N_OUT, K_IN).shape == (2, N_OUT)
    if jax.default_backend() == "cpu":
        with pytest.raises(UnsupportedError):
            qmatmul(x, w, Q.Q8_0, N_OUT, K_IN, impl="kernel")


def test_env_override_falls_back(rng, monkeypatch, capsys):
    """STRATA_PALLAS_IMPL=interpret: the kernel where it serves (any M: 9 rows take the GEMM), the reference (reason
    printed once) where it cannot (a format without a kernel); an explicit impl= still raises."""
    x9 = jnp.asarray(rng.standard_normal((9, K_IN)).astype(np.float32))
    iq = jnp.asarray(random_weight(rng, Q.IQ4_NL, N_OUT, K_IN))
    w = jnp.asarray(random_weight(rng, Q.Q8_0, N_OUT, K_IN))
    monkeypatch.setenv("STRATA_PALLAS_IMPL", "interpret")
    monkeypatch.setattr(dispatch, "_printed", set())  # an earlier test of this process may have printed it already
    y = qmatmul(x9, iq, Q.IQ4_NL, N_OUT, K_IN)
    np.testing.assert_array_equal(y, qmatmul(x9, iq, Q.IQ4_NL, N_OUT, K_IN, impl="reference"))
    assert "cannot serve" in capsys.readouterr().err
    np.testing.assert_array_equal(qmatmul(x9, w, Q.Q8_0, N_OUT, K_IN), qmatmul(x9, w, Q.Q8_0, N_OUT, K_IN,
                                                                               impl="interpret"))
    with pytest.raises(UnsupportedError):
        qmatmul(x9, iq, Q.IQ4_NL, N_OUT, K_IN, impl="interpret")
    monkeypatch.setenv("STRATA_PALLAS_IMPL", "bogus")
    with pytest.raises(UnsupportedError):
        qmatmul(x9, w, Q.Q8_0, N_OUT, K_IN)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "reference"])
def test_gemm_rows_independent(impl, rng):
    """The prefill GEMM (M > 8 without row groups: 16-row groups, one matrix product per chunk): a row's bits do not
    depend on M, on its position in its group, nor on the other rows' contents; close to float64."""
    qtype = Q.Q6_K  # a 16-value sub-block format
    n_out, k_in = 33, 768
    w_raw = random_weight(rng, qtype, n_out, k_in)
    w = jnp.asarray(w_raw)
    X = jnp.asarray(rng.standard_normal((40, k_in)).astype(np.float32))
    y40 = qmatmul(X, w, qtype, n_out, k_in, impl=impl)
    want, scale = f64_bound(X, np.asarray(dequantize(w_raw, qtype, k_in)))
    check_rel(y40, want, scale, 1e-5, f"{impl} GEMM")
    assert_bits_equal(qmatmul(X[:17], w, qtype, n_out, k_in, impl=impl), y40[:17], "M=17 vs M=40")
    perm = jnp.asarray(rng.permutation(40))
    assert_bits_equal(qmatmul(X[perm], w, qtype, n_out, k_in, impl=impl), y40[perm], "rows permuted")
    X2 = X.at[1:].set(jnp.asarray(rng.standard_normal((39, k_in)).astype(np.float32)) * 100)
    assert_bits_equal(qmatmul(X2, w, qtype, n_out, k_in, impl=impl)[0], y40[0], "row 0 with other neighbours")


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "reference"])
def test_ragged_split_and_small_float_k(impl, rng):
    """A weight whose K chunks do not divide evenly into the splits (the last split masked, trip counts fixed) and
    an F16 weight with K = 8 (sub-blocks of 8 values): close to float64, rows alone == rows in an 8-row call."""
    from strata_jax.pallas.quant_matmul import kernel as K

    cases = [(Q.Q8_0, 4, 7 * 256, K.Config(BN=8, chunk=256, target_programs=3, mode="elementwise")),
             (Q.F16, 24, 8, None)]
    for qtype, n_out, k_in, cfg in cases:
        t = K.tiling(qtype, n_out, k_in, cfg or K.choose_config(qtype, n_out, k_in))
        if cfg is not None:
            assert t["masked"] and t["split"] * t["cps"] > t["n_chunks"], t
        w_raw = random_weight(rng, qtype, n_out, k_in)
        X = jnp.asarray(rng.standard_normal((8, k_in)).astype(np.float32))
        with dispatch.poison_outputs():
            y = K.qmatmul_kernel(X, jnp.asarray(w_raw), qtype, n_out, k_in, interpret=impl == "interpret", cfg=cfg)
        want, scale = f64_bound(X, np.asarray(dequantize(w_raw, qtype, k_in)))
        check_rel(y, want, scale, 1e-5, f"{impl} {qtype.name} K={k_in}")
        for i in (0, 5):
            y1 = K.qmatmul_kernel(X[i:i + 1], jnp.asarray(w_raw), qtype, n_out, k_in, interpret=impl == "interpret",
                                  cfg=cfg)
            assert_bits_equal(y1[0], y[i], f"{qtype.name} row {i} alone")


def test_env_ops_filter(monkeypatch):
    """STRATA_PALLAS_OPS limits the env-selected kernels to the named op prefixes; the others run their reference;
    an explicit impl= is not filtered."""
    from strata_jax.pallas import dispatch

    monkeypatch.setenv("STRATA_PALLAS_IMPL", "interpret")
    monkeypatch.setenv("STRATA_PALLAS_OPS", "gdn, grouped_experts")
    assert dispatch.resolve("gdn.gdn_window", "auto", lambda: None) == "interpret"
    assert dispatch.resolve("grouped_experts.moe_experts", "auto", lambda: None) == "interpret"
    assert dispatch.resolve("qsa.qsa_attention", "auto", lambda: None) == "reference"
    assert dispatch.resolve("qsa.qsa_attention", "interpret", lambda: None) == "interpret"
    monkeypatch.delenv("STRATA_PALLAS_OPS")
    assert dispatch.resolve("qsa.qsa_attention", "auto", lambda: None) == "interpret"
