"""`QLinear.stacked`: projections of one input held as one matrix (the hyper-connection down + inject of
`strata_jax.layers.hyper.GatedResidual`), against float64 products of the blocks dequantized by `gguf.quants`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from strata_jax.layers.linear import QLinear
from strata_jax.pallas.quant_matmul import prepare_weight


def _linear(rng, qtype, n_out, n_in, bias=False):
    """A QLinear of fresh random blocks in its device form; returns (linear, float64 W, float64 bias or zeros)."""
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    if qtype == Q.F16:
        raw = w.astype(np.float16)
        w64 = raw.astype(np.float64)
        dev = jnp.asarray(raw)
    else:
        raw = quants.quantize(w, qtype)
        w64 = quants.dequantize(raw, qtype).astype(np.float64)
        dev = prepare_weight(jnp.asarray(raw), qtype, n_in)
    b = rng.standard_normal(n_out).astype(np.float32) if bias else None
    lin = QLinear(dev, qtype, n_out, n_in, None if b is None else jnp.asarray(b))
    return lin, w64, (np.zeros(n_out) if b is None else b.astype(np.float64))


@pytest.fixture(params=["reference", "planar-interpret"])
def path(request, monkeypatch):
    if request.param == "planar-interpret":
        monkeypatch.setenv("STRATA_QMATMUL", "planar")
        monkeypatch.setenv("STRATA_PALLAS_IMPL", "interpret")
    else:
        monkeypatch.setenv("STRATA_PALLAS_IMPL", "reference")
    return request.param


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_stacked_rows_are_the_parts(qtype, path, rng):
    """down [8, K] + inject [4, K] (one with a bias): the stacked call's columns are the parts' outputs within
    1e-5 of float64, rows bitwise independent of the call's other rows (1 row == that row of 3)."""
    k = 512
    (a, a64, ab), (b, b64, bb) = _linear(rng, qtype, 8, k), _linear(rng, qtype, 4, k, bias=True)
    s = QLinear.stacked([a, b])
    assert s is not None and (s.n_out, s.n_in, s.qtype) == (12, k, qtype)
    if path == "planar-interpret":
        assert s.w[...].dtype == jnp.uint32  # the planar form stacks too
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = np.asarray(s(jnp.asarray(x)))
    want = np.concatenate([x @ a64.T + ab, x @ b64.T + bb], axis=1)
    assert np.max(np.abs(y - want)) <= 1e-5 * np.max(np.abs(want))
    np.testing.assert_allclose(y[:, :8], np.asarray(a(jnp.asarray(x))), rtol=0, atol=1e-5 * np.max(np.abs(want)))
    np.testing.assert_array_equal(np.asarray(s(jnp.asarray(x[1:2]))).view(np.uint32), y[1:2].view(np.uint32),
                                  "1 row vs 3: other bits")


def test_stacked_refuses_what_does_not_stack(rng, monkeypatch):
    """Different formats, a different n_in or a different stored form give None (the caller keeps two calls)."""
    monkeypatch.setenv("STRATA_PALLAS_IMPL", "reference")
    q8, _, _ = _linear(rng, Q.Q8_0, 8, 256)
    assert QLinear.stacked([q8, _linear(rng, Q.F16, 4, 256)[0]]) is None
    assert QLinear.stacked([q8, _linear(rng, Q.Q4_0, 4, 256)[0]]) is None
    assert QLinear.stacked([q8, _linear(rng, Q.Q8_0, 4, 512)[0]]) is None
    assert QLinear.stacked([q8, _linear(rng, Q.Q8_0, 4, 256)[0]]) is not None


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_stacked_zero_rows_and_padded_k(qtype, path, rng):
    """n_out past the parts: the extra rows give exact zeros (an all-zero block has scale 0) on every path; an
    F16 matrix widened by padded_k maps [x, anything finite] as it maps x (within 1e-5 of float64; the padding is
    zero columns); block formats cannot be widened; widths below the parts are refused."""
    k = 256
    (a, a64, _), (b, b64, bb) = _linear(rng, qtype, 8, k), _linear(rng, qtype, 4, k, bias=True)
    s = QLinear.stacked([a, b], n_out=32)
    x = rng.standard_normal((2, k)).astype(np.float32)
    y = np.asarray(s(jnp.asarray(x)))
    assert y.shape == (2, 32) and np.all(y[:, 12:] == 0)
    want = np.concatenate([x @ a64.T, x @ b64.T + bb], axis=1)
    assert np.max(np.abs(y[:, :12] - want)) <= 1e-5 * np.max(np.abs(want))
    with pytest.raises(ValueError, match="below"):
        QLinear.stacked([a, b], n_out=11)
    up, up64, _ = _linear(rng, Q.F16, 64, 12)
    wide = up.padded_k(32)
    assert (wide.n_in, wide.n_out) == (32, 64) and a.padded_k(512) is None
    z = np.concatenate([x[:, :12], rng.uniform(-3, 3, (2, 20)).astype(np.float32)], axis=1)
    yz = np.asarray(wide(jnp.asarray(z)))
    want = x[:, :12] @ up64.T
    assert np.max(np.abs(yz - want)) <= 1e-5 * np.max(np.abs(want))


def test_precise_keeps_bf16x2_in_prefill(rng, monkeypatch):
    """A prefill chunk (16 rows, ``exact_rows=False``) through the planar GEMM: a `QLinear` with ``precise`` gets
    the bits of the call at bf16x2 (`gemm.PRECISE_PRECISION`), one without them the bits at f16 (the default), and
    the two differ; ``precise`` survives `QLinear.stacked` / `padded_k` and `project_shared` calls each group at its
    own precision (GDN's q/k/v projection is loaded with it: tests/test_hybrid.py)."""
    from strata_jax.layers.linear import project_shared
    from strata_jax.pallas.quant_matmul import gemm as G
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    monkeypatch.setenv("STRATA_PALLAS_IMPL", "interpret")
    monkeypatch.delenv("STRATA_QMATMUL_PRECISION", raising=False)
    k = 256
    lin, w64, _ = _linear(rng, Q.Q8_0, 40, k)
    exact = QLinear(lin.w, lin.qtype, lin.n_out, lin.n_in, precise=True)
    x = jnp.asarray(rng.standard_normal((16, k)).astype(np.float32))
    bits = lambda y: np.asarray(y).view(np.uint32)  # noqa: E731
    y_f16, y_exact = bits(lin(x, exact_rows=False)), bits(exact(x, exact_rows=False))
    assert np.any(y_f16 != y_exact), "precise made no difference"
    for prec, want in ((G.PRECISE_PRECISION, y_exact), (G.DEFAULT_PRECISION, y_f16)):
        monkeypatch.setenv("STRATA_QMATMUL_PRECISION", prec)
        np.testing.assert_array_equal(bits(lin(x, exact_rows=False)), want, f"{prec}")
    monkeypatch.delenv("STRATA_QMATMUL_PRECISION")
    y64 = np.asarray(x, np.float64) @ w64.T
    assert np.max(np.abs(np.asarray(y_exact.view(np.float32)) - y64)) <= 1e-5 * np.max(np.abs(y64))
    assert QLinear.stacked([exact, lin]).precise and not QLinear.stacked([lin, lin]).precise
    ya, yb = project_shared(x, (exact, lin), exact_rows=False)
    np.testing.assert_array_equal(bits(ya), y_exact)
    np.testing.assert_array_equal(bits(yb), y_f16)
    f = QLinear(jnp.asarray(rng.standard_normal((8, 40)).astype(np.float16)), Q.F16, 8, 40, precise=True)
    assert f.padded_k(64).precise


@pytest.mark.parametrize("variant", ["planar", "bytes"])
def test_prefill_rows_take_the_gemm_at_any_count(variant, rng, monkeypatch):
    """In prefill (``exact_rows=False``) a row has the same bits in a call of 1, 3 or 16 rows (the GEMM at every row
    count; planar weights and the GGUF-bytes kernel), so `head_logits`' "last" row (a 1-row call) gets the logits
    "all" gives it; `project_shared` and the routed experts' prefill path likewise."""
    from strata_jax.layers.linear import head_logits, project_shared
    from strata_jax.pallas.grouped_experts import moe_experts
    from strata_jax.state import Rows
    monkeypatch.setenv("STRATA_QMATMUL", variant)
    monkeypatch.setenv("STRATA_PALLAS_IMPL", "interpret")
    k = 256
    lin, _, _ = _linear(rng, Q.Q8_0, 40, k)
    x = jnp.asarray(rng.standard_normal((16, k)).astype(np.float32))
    bits = lambda y: np.asarray(y).view(np.uint32)  # noqa: E731
    y16 = bits(lin(x, exact_rows=False))
    for m in (1, 3):
        np.testing.assert_array_equal(bits(lin(x[:m], exact_rows=False)), y16[:m], f"{m} prefill rows vs 16")
    assert np.any(bits(lin(x[:1], exact_rows=True)) != y16[:1]), "the window's GEMV gave the GEMM's bits"
    ya, yb = project_shared(x[:2], (lin, lin), exact_rows=False)
    np.testing.assert_array_equal(bits(ya), y16[:2])
    h = x.reshape(2, 8, k)
    rows = Rows.make([0, 1], [0, 0], [8, 5])
    last = head_logits(lin, lambda r: r, h, rows, "prefill", "last")
    every = head_logits(lin, lambda r: r, h, rows, "prefill", "all")
    np.testing.assert_array_equal(bits(last[:, 0]), bits(every[np.arange(2), np.asarray([7, 4])]), "last vs all")
    E, kk = 4, 2
    stack = lambda n, kin: prepare_weight(  # noqa: E731
        jnp.asarray(quants.quantize(rng.standard_normal((E * n, kin)).astype(np.float32), Q.Q8_0)), Q.Q8_0,
        kin).reshape(E, n, -1)
    g, u, d = stack(32, k), stack(32, k), stack(k, 32)
    ids = jnp.asarray(np.stack([rng.choice(E, kk, replace=False) for _ in range(16)]).astype(np.int32))
    tw = jnp.asarray(rng.uniform(0.1, 1, (16, kk)).astype(np.float32))
    full = bits(moe_experts(x, ids, tw, g, u, d, (Q.Q8_0,) * 3, prefill=True))
    np.testing.assert_array_equal(bits(moe_experts(x[:1], ids[:1], tw[:1], g, u, d, (Q.Q8_0,) * 3, prefill=True)),
                                  full[:1], "routed experts: 1 prefill row vs 16")
