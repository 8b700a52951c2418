"""The per-row ops (`strata_jax.pallas.rows`: RMSNorm, L2 norm, row sum, softmax, row map): reference and kernel
(interpret mode) against float64, and row invariance: a row's bits do not depend on how many rows the call holds
nor on what they contain."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.errors import UnsupportedError
from strata_jax.pallas import dispatch, rows

from pallas_testlib import IMPLS, assert_bits_equal, assert_close_rel

EPS = 1e-6


def _sigmoid64(x):
    return 1 / (1 + np.exp(-x))


OPS = {
    "rms_norm": (lambda x, w, impl: rows.rms_norm(x, w, EPS, impl=impl),
                 lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * w),
    "l2_norm": (lambda x, w, impl: rows.rms_norm(x, None, EPS, mean=False, impl=impl),
                lambda x, w: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + EPS)),
    "row_sum": (lambda x, w, impl: rows.row_sum(x, impl=impl), lambda x, w: np.sum(x, -1, keepdims=True)),
    "softmax": (lambda x, w, impl: rows.softmax(x, impl=impl),
                lambda x, w: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(
                    -1, keepdims=True)),
    "row_map": (lambda x, w, impl: rows.row_map(jax.nn.sigmoid, x, impl=impl), lambda x, w: _sigmoid64(x)),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_accuracy_and_rows_independent(op, impl, rng):
    f, f64 = OPS[op]
    # 512: XLA:CPU fuses exp(x - max) differently for >= 8 rows of 512 than for fewer (the router's width)
    for n in (512, 40, 4) if impl != "interpret" or op in ("rms_norm", "row_map") else (40,):
        x = jnp.asarray(rng.standard_normal((3, 5, n)).astype(np.float32) * 2)
        w = jnp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
        with dispatch.poison_outputs():
            y = f(x, w, impl)
        assert y.dtype == jnp.float32
        assert_close_rel(y, f64(np.asarray(x, np.float64), np.asarray(w, np.float64)), 1e-6, f"{op} n={n}")
        # the row alone, and among other rows of another call shape with other contents
        assert_bits_equal(f(x[1:2, 3:4], w, impl)[0, 0], y[1, 3], f"{op} n={n}: row alone")
        other = jnp.asarray(rng.standard_normal((7, n)).astype(np.float32) * 5).at[4].set(x[1, 3])
        assert_bits_equal(f(other, w, impl)[4], y[1, 3], f"{op} n={n}: row among 7 others")


@pytest.mark.parametrize("impl", IMPLS)
def test_add_rms_norm(impl, rng):
    """The fused residual add + RMSNorm: the bits of the add and of `rms_norm` of the sum on the same path,
    float64 accuracy, a row's bits whatever the other rows."""
    for n in (40, 1536):
        x = jnp.asarray(rng.standard_normal((3, 5, n)).astype(np.float32) * 2)
        r = jnp.asarray(rng.standard_normal((3, 5, n)).astype(np.float32))
        w = jnp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
        with dispatch.poison_outputs():
            h, y = rows.add_rms_norm(x, r, w, EPS, impl=impl)
        assert_bits_equal(h, x + r, f"n={n}: the sum")
        assert_bits_equal(y, rows.rms_norm(x + r, w, EPS, impl=impl), f"n={n}: the norm of the sum")
        h64 = np.asarray(x, np.float64) + np.asarray(r, np.float64)
        assert_close_rel(y, h64 / np.sqrt(np.mean(h64 * h64, -1, keepdims=True) + EPS) * np.asarray(w, np.float64),
                         1e-6, f"n={n}")
        assert_bits_equal(rows.add_rms_norm(x[1:2, 3:4], r[1:2, 3:4], w, EPS, impl=impl)[1][0, 0], y[1, 3],
                          f"n={n}: row alone")
    with pytest.raises(UnsupportedError):
        rows.add_rms_norm(x, r[:1], w, EPS, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_weight_per_stream(impl, rng):
    """A [k, n] weight for x [..., k, n] (hyper-connection streams): the bits of the norm times the weight after
    it, in one call; a row's bits whatever the other rows."""
    x = jnp.asarray(rng.standard_normal((3, 4, 40)).astype(np.float32) * 2)
    w = jnp.asarray(rng.uniform(0.5, 1.5, (4, 40)).astype(np.float32))
    with dispatch.poison_outputs():
        y = rows.rms_norm(x, w, EPS, impl=impl)
    assert_bits_equal(y, rows.rms_norm(x, None, EPS, impl=impl) * w, "weight inside vs after")
    assert_bits_equal(rows.rms_norm(x[1:2], w, EPS, impl=impl)[0], y[1], "one row of streams alone")
    with pytest.raises(UnsupportedError):
        rows.rms_norm(x, w[:3], EPS, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_top_k(impl, rng):
    """softmax_top_k: the bits of ``jax.lax.top_k(softmax(x), k)`` on the same path (values and ids, ties to the
    lower id: rows with repeated maxima and a row whose logits all tie), the router's shape (512 experts, k 10)
    and a narrow one, a row's bits alone and among others; k out of range is refused."""
    for n, k in ((512, 10), (6, 6), (40, 1)):
        x = rng.standard_normal((7, n)).astype(np.float32) * 3
        x[1, 3:6] = x[1].max() + 1                     # three tied maxima
        x[2, :] = 0.25                                 # every value ties
        x[3, ::2] = x[3, 0]                            # ties among the tail too
        x = jnp.asarray(x)
        w, ids = rows.softmax_top_k(x, k, impl=impl)
        assert w.dtype == jnp.float32 and ids.dtype == jnp.int32 and w.shape == ids.shape == (7, k)
        w0, ids0 = jax.lax.top_k(rows.softmax(x, impl=impl), k)
        assert_bits_equal(w, w0, f"n={n} k={k}: values vs top_k(softmax)")
        assert_bits_equal(ids, ids0, f"n={n} k={k}: ids vs top_k(softmax)")
        w1, ids1 = rows.softmax_top_k(x[1:2], k, impl=impl)
        assert_bits_equal(w1[0], w[1], f"n={n}: row alone")
        assert_bits_equal(ids1[0], ids[1], f"n={n}: row alone (ids)")
    assert np.asarray(ids0)[2].tolist() == list(range(k))
    with pytest.raises(UnsupportedError):
        rows.softmax_top_k(x, n + 1, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_top_k_renorm(impl, rng):
    """softmax_top_k(renorm_min=...) (the MoE router's renormalisation in its program): the ids of top_k, the
    values within 1e-6 of float64 ``p_top / max(sum p_top, min)`` (a row whose k values sum below the minimum
    included), a row's bits alone and among others, one launch."""
    for n, k, lo in ((512, 10, 2.0 ** -14), (40, 3, 0.5)):
        x = rng.standard_normal((6, n)).astype(np.float32) * 3
        x[4, :] = 0.0                                   # flat row: k / n of the mass (< lo for the 40 / 3 case)
        x = jnp.asarray(x)
        with dispatch.poison_outputs():
            w, ids = rows.softmax_top_k(x, k, renorm_min=lo, impl=impl)
        _, ids0 = jax.lax.top_k(rows.softmax(x, impl=impl), k)
        assert_bits_equal(ids, ids0, f"n={n}: ids")
        x64 = np.asarray(x, np.float64)
        p = np.exp(x64 - x64.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.take_along_axis(p, np.asarray(ids), -1)
        assert_close_rel(w, top / np.maximum(top.sum(-1, keepdims=True), lo), 1e-6, f"n={n}")
        w1, _ = rows.softmax_top_k(x[4:5], k, renorm_min=lo, impl=impl)
        assert_bits_equal(w1[0], w[4], f"n={n}: row alone")
        other = jnp.asarray(rng.standard_normal((9, n)).astype(np.float32)).at[7].set(x[2])
        assert_bits_equal(rows.softmax_top_k(other, k, renorm_min=lo, impl=impl)[0][7], w[2], "row among 9")
        if impl != "reference":
            jaxpr = str(jax.make_jaxpr(lambda a: rows.softmax_top_k(a, k, renorm_min=lo, impl=impl))(x))
            assert jaxpr.count("pallas_call") == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_row_sum_weighted(impl, rng):
    """row_sum(x, w=..., fn=...) (the shared-expert gate ``sigmoid(sum(x * w))`` in one program): within 1e-6
    of float64 at n = 40 and 3e-6 at n = 2560 (the float32 dot's rounding, ~1e-6 of its sum |x w| ~ 100, through
    sigmoid's slope <= 1/4, plus sigmoid's own ulps: 1.04e-6 measured with STRATA_TEST_SEED=1381781242), a row's
    bits alone and among others, one launch; a w of another length is refused."""
    for n in (40, 2560):
        x = jnp.asarray(rng.standard_normal((3, 5, n)).astype(np.float32) * 0.05)
        w = jnp.asarray(rng.standard_normal(n).astype(np.float32))
        with dispatch.poison_outputs():
            y = rows.row_sum(x, w=w, fn=jax.nn.sigmoid, impl=impl)
            s = rows.row_sum(x, w=w, impl=impl)
        dot64 = np.sum(np.asarray(x, np.float64) * np.asarray(w, np.float64), -1, keepdims=True)
        assert_close_rel(y, _sigmoid64(dot64), 1e-6 if n <= 64 else 3e-6, f"n={n}")
        assert_close_rel(s, dot64, 1e-5, f"n={n}: sum")
        assert_bits_equal(rows.row_sum(x[1:2, 3:4], w=w, fn=jax.nn.sigmoid, impl=impl)[0, 0], y[1, 3], "alone")
        other = jnp.asarray(rng.standard_normal((7, n)).astype(np.float32)).at[4].set(x[1, 3])
        assert_bits_equal(rows.row_sum(other, w=w, fn=jax.nn.sigmoid, impl=impl)[4], y[1, 3], "among 7 others")
        if impl != "reference":
            jaxpr = str(jax.make_jaxpr(lambda a: rows.row_sum(a, w=w, fn=jax.nn.sigmoid, impl=impl))(x))
            assert jaxpr.count("pallas_call") == 1
    with pytest.raises(UnsupportedError):
        rows.row_sum(x, w=w[:-1], impl=impl)


def test_errors_and_fallback(monkeypatch, capsys):
    x = jnp.ones((2, 8), jnp.int32)
    with pytest.raises(UnsupportedError):
        rows.row_sum(x, impl="interpret")  # integer rows: no kernel
    monkeypatch.setenv("STRATA_PALLAS_IMPL", "interpret")
    assert rows.row_sum(x).shape == (2, 1)  # falls back to the reference, reason printed once
    assert "cannot serve" in capsys.readouterr().err
    with pytest.raises(UnsupportedError):
        rows.softmax(x.astype(jnp.float32), impl="bogus")


def test_row_map_in_xla_switch(monkeypatch, rng):
    """``STRATA_ROW_MAP=xla`` takes the Pallas launch out of `row_map` on the compiled kernel path only (traced as
    on a GPU): the values are ``fn(x)``'s; interpret and reference keep their paths; a bad value is refused."""
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    x = jnp.asarray(rng.standard_normal((5, 6)).astype(np.float32))
    count = lambda impl: str(jax.make_jaxpr(lambda x: rows.row_map(jax.nn.sigmoid, x, impl=impl))(x)).count(
        "pallas_call")
    assert count("kernel") == 1
    monkeypatch.setenv("STRATA_ROW_MAP", "xla")
    assert count("kernel") == 0 and count("interpret") == 1
    y = rows.row_map(jax.nn.sigmoid, x, impl="kernel")
    assert_close_rel(np.asarray(y), _sigmoid64(np.asarray(x, np.float64)), 1e-6)
    monkeypatch.setenv("STRATA_ROW_MAP", "pallas")
    with pytest.raises(UnsupportedError, match="STRATA_ROW_MAP"):
        rows.row_map(jax.nn.sigmoid, x, impl="kernel")


@pytest.mark.parametrize("impl", IMPLS)
def test_row_sum_fn(impl, rng):
    """``row_sum(x, fn=...)`` (the shared-expert gate ``sigmoid(sum(x * w))``): the bits of ``row_map(fn,
    row_sum(x))`` on the same path, one kernel launch, a row's bits alone and among others; ``STRATA_ROW_MAP=xla``
    leaves ``fn`` to XLA on the compiled kernel path."""
    for n in (40, 2560):
        x = jnp.asarray(rng.standard_normal((3, 5, n)).astype(np.float32) * 0.05)
        with dispatch.poison_outputs():
            y = rows.row_sum(x, fn=jax.nn.sigmoid, impl=impl)
        assert y.shape == (3, 5, 1) and y.dtype == jnp.float32
        assert_bits_equal(y, rows.row_map(jax.nn.sigmoid, rows.row_sum(x, impl=impl), impl=impl),
                          f"n={n}: fn in the sum's program vs row_map after")
        assert_close_rel(y, _sigmoid64(np.sum(np.asarray(x, np.float64), -1, keepdims=True)), 1e-6, f"n={n}")
        assert_bits_equal(rows.row_sum(x[1:2, 3:4], fn=jax.nn.sigmoid, impl=impl)[0, 0], y[1, 3], "row alone")
        other = jnp.asarray(rng.standard_normal((7, n)).astype(np.float32)).at[4].set(x[1, 3])
        assert_bits_equal(rows.row_sum(other, fn=jax.nn.sigmoid, impl=impl)[4], y[1, 3], "row among 7 others")
    if impl != "reference":
        count = lambda: str(jax.make_jaxpr(lambda x: rows.row_sum(x, fn=jax.nn.sigmoid, impl=impl))(x)).count(
            "pallas_call")
        assert count() == 1


def test_row_sum_fn_in_xla_switch(monkeypatch, rng):
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setenv("STRATA_ROW_MAP", "xla")
    x = jnp.asarray(rng.standard_normal((5, 40)).astype(np.float32))
    jaxpr = str(jax.make_jaxpr(lambda x: rows.row_sum(x, fn=jax.nn.sigmoid, impl="kernel"))(x))
    assert jaxpr.count("pallas_call") == 1 and "rows_sum_map" not in jaxpr and "logistic" in jaxpr


@pytest.mark.parametrize("impl", IMPLS)
def test_row_map_scaled_sigmoid(impl, rng):
    """The hyper-connection inject weights, ``sigmoid(v / hc)`` for hc = 4 streams: ``row_map`` of
    `hyper.SigmoidScaled` (the scaling in the map's program) has the bits of ``row_map(sigmoid, v / hc)`` (an XLA
    multiply before it), with huge, tiny and subnormal values; one launch; a row alone."""
    from strata_jax.layers.hyper import SigmoidScaled
    for hc in (4, 2, 8):
        v = rng.standard_normal((3, 5, hc)).astype(np.float32) * 4
        v[0, 0] = [1e-40, -3e-39, 1e38, -1e38, 0.0, -0.0, 7e-45, 90.0][:hc]
        v = jnp.asarray(v)
        with dispatch.poison_outputs():
            y = rows.row_map(SigmoidScaled(1.0 / hc), v, impl=impl)
        assert_bits_equal(y, rows.row_map(jax.nn.sigmoid, v / hc, impl=impl), f"hc={hc}: scale inside vs before")
        assert_bits_equal(rows.row_map(SigmoidScaled(1.0 / hc), v[1:2, 3:4], impl=impl)[0, 0], y[1, 3], "row alone")
    assert SigmoidScaled(0.25) == SigmoidScaled(0.25) and hash(SigmoidScaled(0.25)) == hash(SigmoidScaled(0.25))


@pytest.mark.parametrize("impl", IMPLS)
def test_row_map_read_gates(impl, rng):
    """A hyper-connection read's gates in one row map (`hyper.ReadGates`, lanes by an iota in the program): lanes
    < rank ``silu(v / hc)``, the next hc ``2 * sigmoid(v / hc)``, the padding 0, within 1e-6 of float64 (hc = 4:
    the Flash-Next rank 320 in a 352-lane row; hc = 3: the division); a row alone has its bits; one launch."""
    from strata_jax.layers.hyper import ReadGates
    for rank, hc, width in ((320, 4, 352), (8, 4, 32), (5, 3, 32)):
        v = rng.standard_normal((2, 3, width)).astype(np.float32) * 6
        v[0, 0, :3] = [1e38, -1e38, -0.0]
        g = ReadGates(rank, hc)
        with dispatch.poison_outputs():
            y = np.asarray(rows.row_map(g, jnp.asarray(v), impl=impl))
        x = v.astype(np.float64) / hc
        with np.errstate(over="ignore"):  # exp(1e38 / hc): sigmoid 0, as float32's
            sig = 1 / (1 + np.exp(-x))
        want = np.concatenate([(x * sig)[..., :rank], 2 * sig[..., rank:rank + hc], 0 * x[..., rank + hc:]], -1)
        np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-30, err_msg=f"rank {rank}, hc {hc}")
        assert_bits_equal(rows.row_map(g, jnp.asarray(v[1:2, 2:3]), impl=impl)[0, 0], y[1, 2], "row alone")
        if impl != "reference":
            jaxpr = str(jax.make_jaxpr(lambda a: rows.row_map(g, a, impl=impl))(jnp.asarray(v)))
            assert jaxpr.count("pallas_call") == 1
    assert ReadGates(320, 4) == ReadGates(320, 4) and hash(ReadGates(320, 4)) == hash(ReadGates(320, 4))


@pytest.mark.parametrize("impl", IMPLS)
def test_row_map_multi_gdn_gates(impl, rng):
    """row_map_multi (the GDN gates ``sigmoid(b)``, ``softplus(a + dt_bias) * ssm_a`` in one program): the bits
    of two row maps on the same path (``row_map(sigmoid, b)``; ``row_map(softplus, a + dt_bias) * ssm_a``, the
    add and the product exact either side), within 1e-6 of float64, a row alone, one launch; shapes refused."""
    from strata_jax.layers.gdn import gdn_gates
    for B, T, H in ((2, 3, 48), (1, 1, 6), (3, 4, 32)):
        b = jnp.asarray(rng.standard_normal((B, T, H)).astype(np.float32) * 4)
        a = jnp.asarray(rng.standard_normal((B, T, H)).astype(np.float32) * 4)
        dt = jnp.asarray(rng.standard_normal(H).astype(np.float32))
        A = jnp.asarray(-np.exp(rng.standard_normal(H)).astype(np.float32))
        with dispatch.poison_outputs():
            beta, g = rows.row_map_multi(gdn_gates, (b, a), (dt, A), n_out=2, impl=impl)
        assert_bits_equal(beta, rows.row_map(jax.nn.sigmoid, b, impl=impl), f"{B}x{T}x{H}: beta")
        assert_bits_equal(g, rows.row_map(jax.nn.softplus, a + dt, impl=impl) * A, f"{B}x{T}x{H}: g")
        assert_close_rel(beta, _sigmoid64(np.asarray(b, np.float64)), 1e-6)
        z = np.asarray(a, np.float64) + np.asarray(dt, np.float64)
        assert_close_rel(g, np.logaddexp(0, z) * np.asarray(A, np.float64), 1e-6)
        b1, g1 = rows.row_map_multi(gdn_gates, (b[-1:, -1:], a[-1:, -1:]), (dt, A), n_out=2, impl=impl)
        assert_bits_equal(b1[0, 0], beta[-1, -1], "row alone (beta)")
        assert_bits_equal(g1[0, 0], g[-1, -1], "row alone (g)")
        if impl != "reference":
            jaxpr = str(jax.make_jaxpr(lambda b, a: rows.row_map_multi(gdn_gates, (b, a), (dt, A), n_out=2,
                                                                       impl=impl))(b, a))
            assert jaxpr.count("pallas_call") == 1
    with pytest.raises(UnsupportedError):
        rows.row_map_multi(gdn_gates, (b, a[..., :-1]), (dt, A), n_out=2, impl=impl)
    with pytest.raises(UnsupportedError):
        rows.row_map_multi(gdn_gates, (b, a), (dt[:-1], A), n_out=2, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_hc_write_norm(impl, rng):
    """hc_write_norm (a hyper-connection write and the next read's per-stream norm in one program per stream row):
    within 1e-6 of float64 (``R + y * inj``; its RMSNorm times the stream's weight), the reference path's norm
    the bits of `rms_norm` of its write, a token's rows alone bitwise, one launch;
    mismatched shapes refused."""
    for B, T, hc, D in ((2, 3, 4, 256), (1, 1, 4, 2560), (1, 2, 2, 40)):
        R = rng.standard_normal((B, T, hc, D)).astype(np.float32)
        y = rng.standard_normal((B, T, D)).astype(np.float32)
        inj = rng.uniform(0, 2, (B, T, hc)).astype(np.float32)
        w = rng.standard_normal(hc * D).astype(np.float32)
        args = tuple(map(jnp.asarray, (R, y, inj, w)))
        with dispatch.poison_outputs():
            h, xn = rows.hc_write_norm(*args, 1e-6, impl=impl)
        h64 = R.astype(np.float64) + y[..., None, :].astype(np.float64) * inj[..., :, None]
        xn64 = h64 / np.sqrt(np.mean(h64 * h64, -1, keepdims=True) + 1e-6) * w.reshape(hc, D)
        assert_close_rel(h, h64, 1e-6, f"{B}x{T}x{hc}x{D}: write")
        assert_close_rel(xn, xn64, 1e-6, f"{B}x{T}x{hc}x{D}: norm")
        if impl == "reference":  # (the write's bits are XLA's: inside a jit it may contract y * inj into an FMA)
            assert_bits_equal(xn, rows.rms_norm(h, args[3].reshape(hc, D), 1e-6, impl=impl), "reference: norm")
        h1, xn1 = rows.hc_write_norm(*(a[-1:, -1:] for a in args[:3]), args[3], 1e-6, impl=impl)
        assert_bits_equal(h1[0, 0], h[-1, -1], "token alone (write)")
        assert_bits_equal(xn1[0, 0], xn[-1, -1], "token alone (norm)")
        if impl != "reference":
            jaxpr = str(jax.make_jaxpr(lambda *a: rows.hc_write_norm(*a, 1e-6, impl=impl))(*args))
            assert jaxpr.count("pallas_call") == 1
    with pytest.raises(UnsupportedError):
        rows.hc_write_norm(args[0], args[1][..., :-1], args[2], args[3], 1e-6, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_qk_l2_norm(impl, rng):
    """The GDN's q / k (`rows.qk_l2_norm`): the bits of ``tile(l2norm(q) * Dk^-0.5)`` / ``tile(l2norm(k))``
    (``repeat`` for the grouped order) on the same path, one launch; a row's bits alone; errors."""
    from strata_jax.layers.gdn import L2_EPS
    for (B, T, Hk, Hv, Dk), order in (((2, 3, 2, 6, 40), "tiled"), ((1, 1, 16, 32, 128), "tiled"),
                                      ((2, 2, 2, 4, 24), "grouped"), ((1, 4, 3, 3, 16), "tiled")):
        q = jnp.asarray(rng.standard_normal((B, T, Hk, Dk)).astype(np.float32) * 2)
        k = jnp.asarray(rng.standard_normal((B, T, Hk, Dk)).astype(np.float32))
        s = Dk ** -0.5
        with dispatch.poison_outputs():
            qo, ko = rows.qk_l2_norm(q, k, L2_EPS, q_scale=s, heads=Hv, order=order, impl=impl)
        assert qo.shape == ko.shape == (B, T, Hv, Dk)
        rep = ((lambda a: jnp.tile(a, (1, 1, Hv // Hk, 1))) if order == "tiled"
               else (lambda a: jnp.repeat(a, Hv // Hk, axis=2)))
        l2 = lambda a: rows.rms_norm(a, None, L2_EPS, mean=False, impl=impl)  # noqa: E731
        what = f"{B}x{T}x{Hk}->{Hv}x{Dk} {order}"
        assert_bits_equal(qo, rep(l2(q) * s), f"{what}: q")
        assert_bits_equal(ko, rep(l2(k)), f"{what}: k")
        q1, k1 = rows.qk_l2_norm(q[-1:, -1:], k[-1:, -1:], L2_EPS, q_scale=s, heads=Hv, order=order, impl=impl)
        assert_bits_equal(q1[0, 0], qo[-1, -1], f"{what}: row alone (q)")
        assert_bits_equal(k1[0, 0], ko[-1, -1], f"{what}: row alone (k)")
        if impl != "reference":
            jaxpr = str(jax.make_jaxpr(lambda q, k: rows.qk_l2_norm(q, k, L2_EPS, q_scale=s, heads=Hv, order=order,
                                                                    impl=impl))(q, k))
            assert jaxpr.count("pallas_call") == 1
    for bad in (dict(heads=5, order="tiled"), dict(heads=4, order="other")):
        with pytest.raises(UnsupportedError):
            rows.qk_l2_norm(q, k, L2_EPS, q_scale=1.0, impl=impl, **bad)
    with pytest.raises(UnsupportedError):
        rows.qk_l2_norm(q, k[..., :8], L2_EPS, q_scale=1.0, heads=3, order="tiled", impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_qk_l2_norm_packed(impl, rng):
    """qk_l2_norm_packed: q and k read in place from the GDN's convolved q|k|v rows have the bits of qk_l2_norm of
    the sliced q and k on the same path (tiled / grouped, v wider or narrower than q|k), one launch and no slice
    before it; a row alone; too narrow a c is refused."""
    from strata_jax.layers.gdn import L2_EPS
    for (B, T, Hk, Hv, Dk, Dv), order in (((2, 3, 2, 6, 40, 24), "tiled"), ((1, 1, 16, 48, 128, 128), "tiled"),
                                          ((2, 2, 2, 4, 24, 8), "grouped")):
        nq = Hk * Dk
        c = jnp.asarray(rng.standard_normal((B, T, 2 * nq + Hv * Dv)).astype(np.float32))
        s = Dk ** -0.5
        with dispatch.poison_outputs():
            qo, ko = rows.qk_l2_norm_packed(c, L2_EPS, h=Hk, n=Dk, q_scale=s, heads=Hv, order=order, impl=impl)
        q, k = c[..., :nq].reshape(B, T, Hk, Dk), c[..., nq:2 * nq].reshape(B, T, Hk, Dk)
        q0, k0 = rows.qk_l2_norm(q, k, L2_EPS, q_scale=s, heads=Hv, order=order, impl=impl)
        what = f"{B}x{T}x{Hk}->{Hv}x{Dk} {order}"
        assert_bits_equal(qo, q0, f"{what}: q")
        assert_bits_equal(ko, k0, f"{what}: k")
        q1, _ = rows.qk_l2_norm_packed(c[-1:, -1:], L2_EPS, h=Hk, n=Dk, q_scale=s, heads=Hv, order=order, impl=impl)
        assert_bits_equal(q1[0, 0], qo[-1, -1], f"{what}: row alone")
        if impl != "reference":
            jaxpr = str(jax.make_jaxpr(lambda c: rows.qk_l2_norm_packed(c, L2_EPS, h=Hk, n=Dk, q_scale=s, heads=Hv,
                                                                        order=order, impl=impl))(c))
            before = jaxpr.split("pallas_call")[0]  # (interpret mode slices the padded outputs after the call)
            assert jaxpr.count("pallas_call") == 1 and "slice" not in before, before[-400:]
    with pytest.raises(UnsupportedError):
        rows.qk_l2_norm_packed(c[..., :2 * nq - 1], L2_EPS, h=Hk, n=Dk, q_scale=s, heads=Hv, order=order, impl=impl)
