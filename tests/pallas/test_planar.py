"""The planar device format and its kernels (``STRATA_QMATMUL=planar``): the repack against gguf-py's numpy
decoder for every format, the kernels in interpret mode against float64 (every format through the shared decoders;
the kernels on one format of each decoder family), row invariance (bitwise), poisoned outputs, the tensor-core
precisions, grouped experts (windows and the sorted prefill GEMM), and the model's kernel-path program with planar
weights (structure only: tracing)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as Q

from strata_jax.errors import UnsupportedError
from strata_jax.pallas import dispatch, structure
from strata_jax.pallas.grouped_experts import moe_experts
from strata_jax.pallas.quant_matmul import gemm, gemv, planar, prepare_weight, qmatmul, qmatmul_shared

from pallas_testlib import IMPLS, assert_bits_equal, random_weight

KERNEL_IMPLS = [i for i in IMPLS if i != "reference"]
BLOCK_TYPES = sorted(planar.FORMATS, key=lambda q: q.value)


def oracle(raw, qtype):
    """float64 weights by gguf-py's numpy decoder (IQ1_M: its delta-sign quirk undone, see strata_jax.gguf.blocks)."""
    if qtype == Q.IQ1_M:
        from strata_jax.gguf.blocks import dequantize
        return np.asarray(dequantize(raw, qtype, raw.shape[-1] * 256 // 56), np.float64)
    return gq.dequantize(np.asarray(raw), qtype).astype(np.float64)


def f64_check(y, x, w64, rtol, what):
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    want, scale = x @ w64.T, np.abs(x) @ np.abs(w64).T
    y = np.asarray(y, np.float64)
    assert np.all(np.isfinite(y)), f"{what}: non-finite output (unwritten / poisoned element?)"
    rel = np.max(np.abs(y - want) / scale)
    assert rel <= rtol, f"{what}: max error / (|x|@|w|) = {rel:.3g} > {rtol}"
    return rel


def test_repack_decodes_to_gguf_values(rng):
    """repack + planar.dequantize == gguf-py's numpy dequantize bit for bit, every block format, fresh blocks."""
    K = 256
    raws = {q: random_weight(rng, q, 3, K) for q in BLOCK_TYPES}

    @jax.jit
    def all_formats(raws):
        return {q: planar.dequantize(planar.repack(r, qtype=q, n_cols=K), qtype=q, n_cols=K) for q, r in raws.items()}

    got = all_formats({q: jnp.asarray(r) for q, r in raws.items()})
    for q in BLOCK_TYPES:
        want = oracle(raws[q], q).astype(np.float32)
        assert_bits_equal(np.asarray(got[q]), want, q.name)
        p = planar.repack(jnp.asarray(raws[q]), qtype=q, n_cols=K)
        assert p.dtype == jnp.uint32 and p.shape == (3, planar.row_words(q, K))
        assert planar.row_words(q, K) * 4 <= raws[q].shape[1] + 16 * len(planar.FORMATS[q].regions)


# one format per decoder family: 32-value blocks with a min and two planes, 16-value K-quant scales on (2, 16)
# tiles, 4 + 2 bit planes, the 4-bit table lookup with 6-bit scales, grid + separate high bits + sign bytes, the
# IQ1 delta codes, and a float weight
FAMILIES = [Q.Q5_1, Q.Q3_K, Q.Q6_K, Q.IQ4_XS, Q.IQ2_S, Q.IQ1_M, Q.BF16]


def _weight(rng, qtype, n_out, k_in, lead=()):
    raw = random_weight(rng, qtype, n_out, k_in, lead)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return jnp.asarray(raw), np.asarray(raw, np.float64)
    w64 = oracle(raw.reshape(-1, raw.shape[-1]), qtype).reshape(*lead, n_out, k_in)
    return planar.repack(jnp.asarray(raw), qtype=qtype, n_cols=k_in), w64


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("qtype", FAMILIES + [q for q in gemv.PLANES if q not in FAMILIES], ids=lambda q: q.name)
def test_gemv_accuracy(impl, qtype, rng, monkeypatch):
    """The planar GEMV (3 rows; 20 output rows: a partial tile) within 1e-5 of float64, outputs poisoned first;
    the formats of the plane path (`gemv.PLANES`) on it (``STRATA_QMATMUL_PLANES=all``) and on the decoder path."""
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    if qtype in gemv.PLANES:
        assert gemv.uses_planes(qtype) == (qtype in gemv.PLANES_DEFAULT)
        monkeypatch.setenv("STRATA_QMATMUL_PLANES", "all")
        assert gemv.uses_planes(qtype)
        monkeypatch.setenv("STRATA_QMATMUL_PLANES", "0")
        assert not gemv.uses_planes(qtype)
        n_out, k_in = 20, 512
        w, w64 = _weight(rng, qtype, n_out, k_in)
        x = rng.standard_normal((3, k_in)).astype(np.float32)
        f64_check(qmatmul(jnp.asarray(x), w, qtype, n_out, k_in, impl=impl), x, w64, 1e-5, f"{impl} decoder path")
        monkeypatch.setenv("STRATA_QMATMUL_PLANES", "all")
    n_out, k_in = 20, 512
    w, w64 = _weight(rng, qtype, n_out, k_in)
    x = rng.standard_normal((3, k_in)).astype(np.float32)
    with dispatch.poison_outputs():
        y = qmatmul(jnp.asarray(x), w, qtype, n_out, k_in, impl=impl)
    assert y.shape == (3, n_out) and y.dtype == jnp.float32
    f64_check(y, x, w64, 1e-5, f"{impl} {qtype.name}")


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_plane_x_raw_matches_prepared(impl, rng, monkeypatch):
    """``STRATA_QMATMUL_PLANE_X=raw`` (the kernel scales the activations it loads) gives the bits of the prepared
    activations (`gemv.plane_inputs`): Q4_K (minima: the sums of 16), Q6_K (4 + 2-bit planes) and Q8_0 (8-bit) at 3
    rows, Q4_K with bfloat16 rows, Q2_K's grouped experts with per-slot rows and with rows shared by the slots; an
    unknown value raises."""
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    monkeypatch.setenv("STRATA_QMATMUL_PLANES", "all")
    monkeypatch.setenv("STRATA_QMATMUL_GEMV", "fma")
    n_out, k_in = 20, 512
    for qtype, dtype in ((Q.Q4_K, jnp.float32), (Q.Q6_K, jnp.float32), (Q.Q8_0, jnp.float32),
                         (Q.Q4_K, jnp.bfloat16)):
        w, w64 = _weight(rng, qtype, n_out, k_in)
        x = jnp.asarray(rng.standard_normal((3, k_in)).astype(np.float32)).astype(dtype)
        got = {}
        for mode in ("prepared", "raw"):
            monkeypatch.setenv("STRATA_QMATMUL_PLANE_X", mode)
            with dispatch.poison_outputs():
                got[mode] = qmatmul(x, w, qtype, n_out, k_in, impl=impl)
        assert_bits_equal(got["raw"], got["prepared"], f"{qtype.name}: raw vs prepared activations")
        f64_check(got["raw"], x, w64, 1e-5, f"{qtype.name} raw")
    ws, _ = _weight(rng, Q.Q2_K, n_out, k_in, lead=(3,))
    slots = jnp.asarray([2, 0], jnp.int32)
    for shape in ((2, 3, k_in), (3, k_in)):
        xs = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
        got = {}
        for mode in ("prepared", "raw"):
            monkeypatch.setenv("STRATA_QMATMUL_PLANE_X", mode)
            got[mode] = gemv.grouped_gemv(xs, ws, slots, Q.Q2_K, n_out, k_in, interpret=impl == "interpret")
        assert_bits_equal(got["raw"], got["prepared"], f"Q2_K grouped experts, x {shape}: raw vs prepared")
    monkeypatch.setenv("STRATA_QMATMUL_PLANE_X", "scaled")
    with pytest.raises(UnsupportedError, match="STRATA_QMATMUL_PLANE_X"):
        gemv.plane_x_mode()


def test_gemv_config_tables(monkeypatch):
    """`gemv.choose_config` per format from the 2026-12-07 sweep (the default) and the 2026-12-04 table under
    ``STRATA_QMATMUL_GEMV_CONFIGS``; the Flash-Next shapes' K splits stay in range (one loop step per program for
    the float weights, G cut to divide K: 352 = 11 groups); another value raises."""
    monkeypatch.delenv("STRATA_QMATMUL_GEMV_CONFIGS", raising=False)
    monkeypatch.delenv("STRATA_QMATMUL_PLANES", raising=False)
    cases = {(Q.Q4_K, 6144, 2560): (gemv.TWO_WARPS, gemv.PLANES_Q4K),
             (Q.Q4_K, 8960, 1536): (gemv.PLANES_Q4K_SMALL_K, gemv.PLANES_Q4K_SMALL_K),
             (Q.Q4_0, 2560, 640): (gemv.TWO_WARPS, gemv.DEFAULT), (Q.Q2_K, 640, 2560): (gemv.NARROW, gemv.DEFAULT),
             (Q.Q6_K, 248320, 2560): (gemv.TWO_WARPS, gemv.HEAD_Q6K),
             (Q.Q6_K, 1536, 8960): (gemv.ONE_STEP, gemv.DEFAULT),
             (Q.BF16, 10240, 352): (gemv.ONE_STEP, gemv.DEFAULT), (Q.Q8_0, 2560, 640): (gemv.WIDE, gemv.DEFAULT),
             (Q.IQ4_XS, 2560, 2560): (gemv.DEFAULT, gemv.DEFAULT)}
    for table, i in (("2026-12-07", 0), ("2026-12-04", 1)):
        monkeypatch.setenv("STRATA_QMATMUL_GEMV_CONFIGS", table)
        for (qt, n, k), want in cases.items():
            assert gemv.choose_config(qt, n, k) == want[i], (table, qt.name, n, k)
    monkeypatch.delenv("STRATA_QMATMUL_GEMV_CONFIGS")
    assert gemv.choose_config(Q.Q2_K, 640, 2560) == gemv.NARROW
    t = gemv.tiling(Q.BF16, 10240, 352, gemv.ONE_STEP)
    assert (t["G"], t["n_chunks"], t["cps"], t["split"]) == (1, 11, 1, 11)
    t = gemv.tiling(Q.BF16, 352, 10240, gemv.ONE_STEP)
    assert (t["G"], t["cps"], t["split"], t["n_tiles"]) == (4, 1, 80, 11)
    monkeypatch.setenv("STRATA_QMATMUL_GEMV_CONFIGS", "fastest")
    with pytest.raises(UnsupportedError, match="STRATA_QMATMUL_GEMV_CONFIGS"):
        gemv.choose_config(Q.Q4_K, 6144, 2560)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("gemv", ["fma", "tc"])
def test_gemv_rows_independent(impl, gemv, rng, monkeypatch):
    """Row m of an M-row call == the row alone, bit for bit, whatever the other rows hold (M = 3, 8, and 12 with
    row groups); both GEMV variants."""
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    monkeypatch.setenv("STRATA_QMATMUL_GEMV", gemv)
    qtype, n_out, k_in = Q.Q4_K, 24, 512
    w, w64 = _weight(rng, qtype, n_out, k_in)
    X = jnp.asarray(rng.standard_normal((12, k_in)).astype(np.float32))
    alone = np.stack([np.asarray(qmatmul(X[i:i + 1], w, qtype, n_out, k_in, impl=impl))[0] for i in (0, 2, 7, 11)])
    Y = qmatmul(X, w, qtype, n_out, k_in, impl=impl, row_groups=True)
    assert_bits_equal(np.asarray(Y)[[0, 2, 7, 11]], alone, f"{gemv}: M=12 (row groups) vs rows alone")
    f64_check(Y, X, w64, 1e-5, f"{gemv} accuracy")
    X2 = X.at[1:].set(X[1:] * 100 + 1)
    assert_bits_equal(qmatmul(X2[:3], w, qtype, n_out, k_in, impl=impl)[0], alone[0], "row 0, other neighbours")


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.BF16], ids=lambda q: q.name)
def test_shared_launch_matches_separate_calls(impl, qtype, rng, monkeypatch):
    """`qmatmul_shared` (two weights of one format and shape in one launch: a gated MLP's gate and up) gives each
    output the bits of its own `qmatmul` call, at 1, 3 and 8 rows and with row groups (M = 12); outputs poisoned
    first, so an unwritten element shows; within 1e-5 of float64."""
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    monkeypatch.setenv("STRATA_QMATMUL_GEMV", "fma")
    n_out, k_in = 40, 512
    (w1, w1_64), (w2, w2_64) = _weight(rng, qtype, n_out, k_in), _weight(rng, qtype, n_out, k_in)
    for M, rg in ((1, False), (3, False), (8, False), (12, True)):
        x = jnp.asarray(rng.standard_normal((M, k_in)).astype(np.float32))
        with dispatch.poison_outputs():
            got = qmatmul_shared(x, (w1, w2), qtype, n_out, k_in, impl=impl, row_groups=rg)
            want = [qmatmul(x, w, qtype, n_out, k_in, impl=impl, row_groups=rg) for w in (w1, w2)]
        for g, w, w64, name in zip(got, want, (w1_64, w2_64), ("gate", "up")):
            assert_bits_equal(g, w, f"{qtype.name} M={M} {name}: shared launch vs its own call")
            f64_check(g, x, w64, 1e-5, f"{qtype.name} M={M} {name}")


def test_shared_launch_program(rng, monkeypatch):
    """On the kernel path the shared form is one Pallas call (traced as on a GPU); a weight of another shape is
    refused with the shape error (`project_shared` groups projections by format and shape)."""
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    monkeypatch.setenv("STRATA_QMATMUL_GEMV", "fma")
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    qtype, k_in = Q.Q4_K, 256
    w1, _ = _weight(rng, qtype, 32, k_in)
    w2, _ = _weight(rng, qtype, 32, k_in)
    w3, _ = _weight(rng, qtype, 48, k_in)
    x = jnp.asarray(rng.standard_normal((2, k_in)).astype(np.float32))

    def kernels(ws, n):
        jx = jax.make_jaxpr(lambda x, *ws: qmatmul_shared(x, ws, qtype, n, k_in, impl="kernel"))(x, *ws)
        return structure.jaxpr_report(jx).kernels
    assert kernels((w1, w2), 32) == ["qmatmul_planar_Q4_K_x2"]
    monkeypatch.setenv("STRATA_QMATMUL_SHARED", "0")
    assert kernels((w1, w2), 32) == ["qmatmul_planar_Q4_K"] * 2
    with pytest.raises(UnsupportedError, match="expected"):
        qmatmul_shared(x, (w1, w3), qtype, 32, k_in, impl="kernel")


# 32-value units with a min, 16-value units, 8-bit codes, a float weight, a 4-bit table lookup
TC16_TYPES = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.BF16, Q.IQ4_XS]


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("qtype", TC16_TYPES, ids=lambda q: q.name)
def test_tc16_accuracy(impl, qtype, rng, monkeypatch):
    """The tensor-core GEMV (STRATA_QMATMUL_GEMV=tc16; 3 rows padded to 16; 20 output rows: a partial tile)
    against float64 at bf16x3 (float32-like; and bf16x2 for Q4_K), outputs poisoned first."""
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    monkeypatch.setenv("STRATA_QMATMUL_GEMV", "tc16")
    n_out, k_in = 20, 512
    w, w64 = _weight(rng, qtype, n_out, k_in)
    x = rng.standard_normal((3, k_in)).astype(np.float32)
    for prec, tol in (("bf16x3", 1e-6), ("bf16x2", 1e-5))[:2 if qtype == Q.Q4_K else 1]:
        monkeypatch.setenv("STRATA_QMATMUL_PRECISION", prec)
        with dispatch.poison_outputs():
            y = qmatmul(jnp.asarray(x), w, qtype, n_out, k_in, impl=impl)
        assert y.shape == (3, n_out) and y.dtype == jnp.float32
        f64_check(y, x, w64, tol, f"{impl} tc16 {qtype.name} {prec}")


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_tc16_rows_independent(impl, rng):
    """tc16: row r of an M-row call == the row alone == the row among 7 other rows of different values, bit for
    bit (M = 1, 3, 8, 16, and 20: two 16-row tiles), 16-value units (Q6_K) and a format with a min (Q4_K)."""
    from strata_jax.pallas.quant_matmul import tcgemv
    interpret = impl == "interpret"
    for qtype in (Q.Q4_K, Q.Q6_K):
        n_out, k_in = 24, 512
        w, w64 = _weight(rng, qtype, n_out, k_in)
        X = jnp.asarray(rng.standard_normal((20, k_in)).astype(np.float32))

        call = jax.jit(lambda x, w: tcgemv.gemv(x, w, qtype, n_out, k_in, interpret=interpret))

        def run(x):
            return np.asarray(call(x, w))

        Y = run(X)
        f64_check(Y, X, w64, 1e-6, f"tc16 {qtype.name} M=20")
        picks = [0, 2, 7, 15, 19]
        alone = np.stack([run(X[i:i + 1])[0] for i in picks])
        assert_bits_equal(Y[picks], alone, f"{qtype.name}: M=20 vs rows alone")
        for m in (3, 8, 16):
            assert_bits_equal(run(X[:m])[[i for i in picks if i < m]], alone[[i < m for i in picks]],
                              f"{qtype.name}: M={m} vs rows alone")
        others = jnp.concatenate([X[2:3], X[:7] * 100 + 1])          # row 2 first, 7 other rows
        assert_bits_equal(run(others)[0], alone[1], f"{qtype.name}: row 2 among other rows")


# The GEMM's bound on max |y - y64| / (|x| @ |w|) per precision (bfloat16 pieces per inexact operand). Measured in
# interpret mode (2026-12-05, 150 rows x K 1024 x 64 outputs, prefill tiles) over KBLOCK_TYPES: kblock bf16 3.4e-4
# .. 5.3e-4, bf16x2 4.9e-7 .. 1.1e-6, bf16x3 2.6e-8 .. 3.6e-8; unit bf16 2.8e-4 .. 3.7e-4, bf16x2 9.0e-7 .. 2.3e-6,
# bf16x3 3.1e-8 .. 6.5e-8.
GEMM_BOUNDS = {"bf16": 4e-3, "bf16x2": 1e-5, "bf16x3": 1e-6}


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("variant", gemm.VARIANTS)
def test_gemm_precisions_and_rows(impl, variant, rng, monkeypatch):
    """The tensor-core GEMM (M > 8) through `qmatmul`, each kernel (STRATA_QMATMUL_GEMM): each precision's
    accuracy against float64 (bf16: operands rounded once, ~1e-3; bf16x2 ~1e-6; bf16x3 float32-like), and a
    row's bits independent of the chunk's row count, the row's position and the other rows."""
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    monkeypatch.setenv("STRATA_QMATMUL_GEMM", variant)
    qtype, n_out, k_in = Q.Q6_K, 40, 256
    w, w64 = _weight(rng, qtype, n_out, k_in)
    X = jnp.asarray(rng.standard_normal((40, k_in)).astype(np.float32))
    for prec, tol in GEMM_BOUNDS.items():
        monkeypatch.setenv("STRATA_QMATMUL_PRECISION", prec)
        with dispatch.poison_outputs():
            y = qmatmul(X, w, qtype, n_out, k_in, impl=impl)
        rel = f64_check(y, X, w64, tol, f"{impl} {variant} GEMM {prec}")
        if prec == "bf16":
            assert rel > 1e-5, f"bf16 ({rel:.2g}) is no less accurate than bf16x3: the precision switch is ignored"
    perm = jnp.asarray(rng.permutation(40)[:17])
    assert_bits_equal(qmatmul(X[perm], w, qtype, n_out, k_in, impl=impl), np.asarray(y)[np.asarray(perm)],
                      "17 permuted rows vs 40")
    monkeypatch.setenv("STRATA_QMATMUL_PRECISION", "bf17")
    with pytest.raises(UnsupportedError):
        qmatmul(X, w, qtype, n_out, k_in, impl=impl)


def test_gemm_variant_switch(rng, monkeypatch):
    """STRATA_QMATMUL_GEMM picks the GEMM's kernel (traced as on a GPU: kblock by default, unit on request) and
    reaches the MoE prefill GEMM too; an unknown value raises."""
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    w, _ = _weight(rng, Q.Q4_K, 32, 256)
    x = jnp.zeros((16, 256), jnp.float32)
    ws = [_weight(rng, Q.Q4_K, 256, 256, (2,))[0] for _ in range(3)]     # 2 experts' gate, up, down
    ids = jnp.asarray(np.tile([[0, 1]], (16, 1)).astype(np.int32))
    tw = jnp.ones((16, 2), jnp.float32)

    def kernels(fn, *args):   # a new function each time: make_jaxpr caches the trace by function
        return set(structure.jaxpr_report(jax.make_jaxpr(lambda *a: fn(*a))(*args)).kernels)
    dense = lambda x, w: qmatmul(x, w, Q.Q4_K, 32, 256, impl="kernel")  # noqa: E731
    moe = lambda x, *ws: moe_experts(x, ids, tw, *ws, Q.Q4_K, impl="kernel", prefill=True)  # noqa: E731
    monkeypatch.delenv("STRATA_QMATMUL_GEMM", raising=False)
    assert gemm.gemm_variant() == gemm.DEFAULT_VARIANT == "kblock"
    assert kernels(dense, x, w) == {"qmatmul_tc_Q4_K_kblock"}
    assert kernels(moe, x, *ws) == {"qmatmul_tc_Q4_K_kblock"}
    monkeypatch.setenv("STRATA_QMATMUL_GEMM", "unit")
    assert kernels(dense, x, w) == {"qmatmul_tc_Q4_K"}
    assert kernels(moe, x, *ws) == {"qmatmul_tc_Q4_K"}
    monkeypatch.setenv("STRATA_QMATMUL_GEMM", "tiles")
    with pytest.raises(UnsupportedError, match="STRATA_QMATMUL_GEMM"):
        qmatmul(x, w, Q.Q4_K, 32, 256, impl="kernel")


# The K-block kernel: the shipped models' formats (Q4_K, Q6_K, Q8_0, Q2_K, Q4_0), a 4-bit table lookup with 6-bit
# scales (IQ4_XS), a grid format with sign bits (IQ2_S), the float weights
KBLOCK_TYPES = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q2_K, Q.Q4_0, Q.IQ4_XS, Q.IQ2_S, Q.F16, Q.BF16, Q.F32]


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("qtype", KBLOCK_TYPES, ids=lambda q: q.name)
def test_kblock_accuracy(impl, qtype, rng):
    """The K-block GEMM against float64 of gguf-py's weights at each precision, outputs poisoned first: the
    prefill tiles (37 rows in one 128-row tile, 40 output rows in a partial 128-row weight tile) and the 16-row
    tiles of the tensor-core GEMV (3 tiles, KB = 128; MoE prefill's `gemm.MOE_PREFILL`, KB = 64, is the tile-path
    test's config); bf16 must be measurably worse."""
    interpret = impl == "interpret"
    n_out, k_in = 40, 512
    w, w64 = _weight(rng, qtype, n_out, k_in)
    x = rng.standard_normal((37, k_in)).astype(np.float32)
    for cfg in (None, gemm.kblock_config(qtype, n_out, k_in, BM=16)):
        for prec, tol in GEMM_BOUNDS.items():
            with dispatch.poison_outputs():
                y = gemm.gemm(jnp.asarray(x), w, qtype, n_out, k_in, interpret=interpret, precision=prec,
                              cfg=cfg, variant="kblock")
            assert y.shape == (37, n_out) and y.dtype == jnp.float32
            rel = f64_check(y, x, w64, tol, f"{impl} kblock {qtype.name} {prec} BM={cfg.BM if cfg else 128}")
            if prec == "bf16":
                assert rel > 1e-5, f"bf16 {rel:.2g}: the precision is ignored"


# the f16 precision's bound on max |y - y64| / (|x| @ |w|): measured in interpret mode (2026-12-07, 37 rows x K 512
# x 40 outputs, one row x 1e6 and one x 1e-7) over KBLOCK_TYPES' block formats and F16: 4.8e-5 .. 9.3e-5 (bf16
# 4.2e-4 .. 6.9e-4 on the same inputs). Empirical: a row dominated by one value can reach ~2^-10 (a review's probe,
# one value 3e38: 6.1e-4)
F16_BOUND = 3e-4


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_kblock_f16_prefill_tiles(impl, rng, monkeypatch):
    """The f16 prefill tiles of `gemm.kblock_config` (2 row sub-tiles below `KBLOCK_WIDE_N` output rows, a third
    pipelining stage from it) give a row the bits of `KBLOCK_PREFILL` itself, in chunks of 1, 200 and 300 rows
    (3,072 output rows: one and two programs of 2 x 128 rows; 4,096: one to three 128-row programs), over a K loop
    of 4 steps per program (48 / 64 weight tiles: no K split). The default tiles (cfg None) take them at f16 on
    block formats only (BF16 weights fall back to bf16x2: plain tiles), with one sub-tile for calls of <= 128 rows."""
    interpret = impl == "interpret"
    k_in = 256
    x = jnp.asarray(rng.standard_normal((300, k_in)).astype(np.float32))
    for n_out in (3072, gemm.KBLOCK_WIDE_N):
        w, _ = _weight(rng, Q.Q4_K, n_out, k_in)
        chosen = gemm.kblock_config(Q.Q4_K, n_out, k_in, f16=True)
        plain = gemm.kblock_config(Q.Q4_K, n_out, k_in)
        assert plain == dataclasses.replace(gemm.KBLOCK_PREFILL, KB=plain.KB)
        assert (chosen.SUB, chosen.num_stages) == ((1, 3) if n_out >= gemm.KBLOCK_WIDE_N else (2, 2)), chosen
        tiles = gemm.split_k(k_in // chosen.KB, -(-n_out // chosen.BN), 1, chosen.target_programs)
        assert tiles["split"] == 1 and tiles["cps"] == 4, tiles   # the accumulators carried over 4 steps
        call = jax.jit(lambda x, w, cfg, prec="f16": gemm.gemm(x, w, Q.Q4_K, n_out, k_in, interpret=interpret,
                                                               precision=prec, cfg=cfg, variant="kblock"),
                       static_argnames=("cfg", "prec"))
        for m in (1, 200, 300):
            with dispatch.poison_outputs():
                want = np.asarray(call(x[:m], w, plain))
                got = np.asarray(call(x[:m], w, chosen))
                dflt = np.asarray(call(x[:m], w, None))
            assert_bits_equal(got, want, f"n_out={n_out} M={m}: {chosen} vs KBLOCK_PREFILL")
            assert_bits_equal(dflt, want, f"n_out={n_out} M={m}: the default tiles")
        assert gemm.kblock_config(Q.Q4_K, n_out, k_in, f16=False) == plain   # bf16x2 / bf16x3 as swept at bf16x2
    n_out = 40   # which config the default takes (traced only)
    wq, _ = _weight(rng, Q.Q4_K, n_out, k_in)
    wb, _ = _weight(rng, Q.BF16, n_out, k_in)
    seen = []
    tile_gemm = gemm.tile_gemm
    monkeypatch.setattr(gemm, "tile_gemm", lambda *a, cfg, **kw: seen.append(cfg) or tile_gemm(*a, cfg=cfg, **kw))
    for w, qt, m, prec in ((wq, Q.Q4_K, 200, "f16"), (wq, Q.Q4_K, 200, "bf16x2"), (wq, Q.Q4_K, 128, "f16"),
                           (wb, Q.BF16, 200, "f16")):
        jax.eval_shape(lambda x, w: gemm.gemm(x, w, qt, n_out, k_in, interpret=True, precision=prec,
                                              variant="kblock"), x[:m], w)
    monkeypatch.undo()
    chosen = gemm.kblock_config(Q.Q4_K, n_out, k_in, f16=True)
    plain = gemm.kblock_config(Q.Q4_K, n_out, k_in)
    assert seen == [chosen, plain, dataclasses.replace(chosen, SUB=1), plain], seen


def test_moe_prefill_config():
    """`gemm.moe_prefill_config`: row sub-tiles from the chunk's average (row, expert) pairs per expert, KB =
    `MOE_F16_KB` at f16, the rest `MOE_PREFILL` (the bits do not depend on SUB:
    test_grouped_experts.py::test_prefill_row_sub_tiles)."""
    for rows, k, e, sub in ((512, 10, 512, 1), (2048, 10, 512, 4), (1024, 10, 512, 2), (819, 10, 512, 1),
                            (820, 10, 512, 2), (512, 8, 256, 2), (8, 2, 8, 1), (64, 2, 4, 4), (1, 10, 512, 1)):
        cfg = gemm.moe_prefill_config(rows, k, e)
        assert cfg == dataclasses.replace(gemm.MOE_PREFILL, SUB=sub), (rows, k, e, cfg)
        cfg = gemm.moe_prefill_config(rows, k, e, f16=True)
        assert cfg == dataclasses.replace(gemm.MOE_PREFILL, SUB=sub, KB=gemm.MOE_F16_KB), (rows, k, e, cfg)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_kblock_f16(impl, rng, monkeypatch):
    """The K-block GEMM at precision f16 (one float16 product; each activation row scaled by a power of two):
    within `F16_BOUND` of float64 and at least 3x bf16's accuracy for the block formats and F16, rows 1e6x and
    1e-7x the others finite and as accurate (the scaling: float16 alone overflows at 65504 and flushes below
    6e-8); a row's bits the same alone and in a permuted chunk; BF16 / F32 weights and the unit kernel take
    bf16x2's pieces (same bits); STRATA_QMATMUL_PRECISION=f16 leaves the tensor-core GEMVs at theirs."""
    from strata_jax.pallas.quant_matmul import api as qapi
    interpret = impl == "interpret"
    n_out, k_in = 40, 512
    x = rng.standard_normal((37, k_in)).astype(np.float32)
    x[3] *= 1e6
    x[5] *= 1e-7
    X = jnp.asarray(x)
    for qtype in [Q.Q4_K, Q.Q6_K, Q.Q2_K, Q.Q4_0, Q.IQ4_XS, Q.F16, Q.BF16, Q.F32]:
        w, w64 = _weight(rng, qtype, n_out, k_in)
        call = jax.jit(lambda x, w, prec: gemm.gemm(x, w, qtype, n_out, k_in, interpret=interpret, precision=prec,
                                                    variant="kblock"), static_argnames="prec")
        with dispatch.poison_outputs():
            y = np.asarray(call(X, w, "f16"))
        if qtype in (Q.BF16, Q.F32):
            assert_bits_equal(y, np.asarray(call(X, w, "bf16x2")), f"{qtype.name} weights: f16 is bf16x2")
            continue
        rel = f64_check(y, x, w64, F16_BOUND, f"{impl} kblock {qtype.name} f16")
        rel_bf16 = f64_check(call(X, w, "bf16"), x, w64, 4e-3, f"{impl} kblock {qtype.name} bf16")
        assert rel * 3 < rel_bf16, f"{qtype.name}: f16 {rel:.2g} is not 3x bf16's {rel_bf16:.2g}"
        perm = rng.permutation(37)[:11]
        assert_bits_equal(np.asarray(call(X[perm], w, "f16")), y[perm], f"{qtype.name} f16: 11 permuted rows")
        assert_bits_equal(np.asarray(call(X[3:4], w, "f16"))[0], y[3], f"{qtype.name} f16: the 1e6 row alone")
    w, _ = _weight(rng, Q.Q4_K, n_out, k_in)
    unit = lambda prec: gemm.gemm(X[:9], w, Q.Q4_K, n_out, k_in, interpret=interpret, precision=prec,  # noqa: E731
                                  variant="unit")
    assert_bits_equal(unit("f16"), unit("bf16x2"), "unit kernel: f16 is bf16x2")
    monkeypatch.delenv("STRATA_QMATMUL_PRECISION", raising=False)
    assert (qapi.precision(True), qapi.precision(True, precise=True), qapi.precision(False)) == (
        "f16", "bf16x2", gemm.GEMV_PRECISION)   # the defaults: GEMM, precise GEMM (GDN's q/k/v), tensor-core GEMV
    monkeypatch.setenv("STRATA_QMATMUL_PRECISION", "f16")
    assert (qapi.precision(True), qapi.precision(True, precise=True), qapi.precision(False)) == (
        "f16", "f16", gemm.GEMV_PRECISION)      # set, the variable applies to every GEMM
    monkeypatch.setenv("STRATA_QMATMUL_PRECISION", "bf16x3")
    assert (qapi.precision(True), qapi.precision(True, precise=True), qapi.precision(False)) == ("bf16x3",) * 3


@pytest.mark.parametrize("qtype", BLOCK_TYPES + [Q.F16, Q.BF16, Q.F32], ids=lambda q: q.name)
def test_kblock_weights_exact(qtype, rng):
    """The K-block kernel forms the weights of `planar.dequantize` (= gguf-py's) exactly: one-hot activation rows
    at bf16x3 (three pieces hold a float32 weight exactly; the products by 1.0 and 0.0 are exact) give back every
    weight bit for bit (up to the sign of zero; interpret mode)."""
    n_out, k_in = 24, 256
    w, w64 = _weight(rng, qtype, n_out, k_in)
    eye = jnp.eye(k_in, dtype=jnp.float32)
    y = gemm.gemm(eye, w, qtype, n_out, k_in, interpret=True, precision="bf16x3", variant="kblock")
    want = (np.asarray(w, np.float32) if qtype in (Q.F32, Q.F16, Q.BF16)
            else np.asarray(planar.dequantize(w, qtype=qtype, n_cols=k_in)))
    assert_bits_equal(want, w64.astype(np.float32), f"{qtype.name}: planar.dequantize vs gguf-py")
    # + 0.0: a zero weight (e.g. 0 * a negative d) comes back as +0.0 (the accumulator starts at +0.0)
    assert_bits_equal(np.ascontiguousarray(np.asarray(y).T), want + np.float32(0),
                      f"{qtype.name}: kernel weights vs planar.dequantize")


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_kblock_rows_independent(impl, rng):
    """K-block GEMM, bitwise: a row's result is the same alone, among 149 other rows (two 128-row tiles), in a
    17-row permuted chunk, and among rows 100x larger (Q4_K at bf16x2: a min per unit; Q6_K at bf16x3: 16-value
    units); and the 16-row tile path of MoE prefill (`tile_gemm`, two stacked matrices): a (row, matrix) pair has
    the same bits in every tile and position it appears in, in calls of 4 and 2 tiles."""
    interpret = impl == "interpret"
    for qtype, prec in ((Q.Q4_K, "bf16x2"), (Q.Q6_K, "bf16x3")):
        n_out, k_in = 24, 512
        w, w64 = _weight(rng, qtype, n_out, k_in)
        X = jnp.asarray(rng.standard_normal((150, k_in)).astype(np.float32))
        call = jax.jit(lambda x, w: gemm.gemm(x, w, qtype, n_out, k_in, interpret=interpret, precision=prec,
                                              variant="kblock"))
        Y = np.asarray(call(X, w))
        f64_check(Y, X, w64, GEMM_BOUNDS[prec], f"kblock {qtype.name} M=150")
        picks = np.asarray([0, 5, 127, 128, 149])
        alone = np.stack([np.asarray(call(X[i:i + 1], w))[0] for i in picks])
        assert_bits_equal(Y[picks], alone, f"{qtype.name}: M=150 vs rows alone")
        perm = rng.permutation(150)[:17]
        assert_bits_equal(np.asarray(call(X[perm], w)), Y[perm], f"{qtype.name}: 17 permuted rows vs 150")
        others = jnp.concatenate([X[:7] * 100 + 1, X[127:128], X[:40]])     # row 127 at position 7
        assert_bits_equal(np.asarray(call(others, w))[7], Y[127], f"{qtype.name}: row 127 among other rows")

    qtype, n_out, k_in, E = Q.Q4_K, 40, 512, 2
    ws, w64 = _weight(rng, qtype, n_out, k_in, (E,))
    X = jnp.asarray(rng.standard_normal((30, k_in)).astype(np.float32))
    cfg = gemm.MOE_PREFILL
    rows4 = rng.integers(0, 30, (4, cfg.BM)).astype(np.int32)
    rows4[2, 5], rows4[0, 11], rows4[3, 0] = 7, 7, 7                      # row 7 in tiles 0, 2, 3
    exp4 = np.asarray([1, 0, 1, 0], np.int32)
    rows2 = np.stack([rows4[2][::-1], rows4[0]])                          # tile 2 reversed, tile 0 as is
    exp2 = np.asarray([1, 1], np.int32)
    call = jax.jit(lambda x, ws, e, r: gemm.tile_gemm(x, ws, e, r, qtype, n_out, k_in, interpret=interpret,
                                                      precision="bf16x2", cfg=cfg, variant="kblock"))
    with dispatch.poison_outputs():
        Y4 = np.asarray(call(X, ws, jnp.asarray(exp4), jnp.asarray(rows4)))
        Y2 = np.asarray(call(X, ws, jnp.asarray(exp2), jnp.asarray(rows2)))
    seen = {}
    for Y, rows, exps in ((Y4, rows4, exp4), (Y2, rows2, exp2)):
        for t in range(rows.shape[0]):
            for b in range(cfg.BM):
                key = (int(rows[t, b]), int(exps[t]))
                if key in seen:
                    assert_bits_equal(Y[t, b], seen[key], f"tile path: row {key[0]} of matrix {key[1]}")
                else:
                    seen[key] = Y[t, b]
            f64_check(Y[t], np.asarray(X)[rows[t]], w64[exps[t]], 1e-5, f"tile path, tile {t}")
    assert len(seen) < Y4.shape[0] * cfg.BM + Y2.shape[0] * cfg.BM   # some pairs were compared


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("variant", gemm.VARIANTS)
def test_grouped_experts_planar(impl, variant, rng, monkeypatch):
    """Routed experts on planar Q2_K / IQ4_NL stacks: the window path (union slots, 8-row groups) and the prefill
    path (pairs sorted by expert, grouped tensor-core GEMM, each STRATA_QMATMUL_GEMM kernel) against float64
    (1e-5 of the largest output; the prefill path 2e-3 at its default f16 products, 5e-5 at bf16x2); rows bitwise
    independent of the call's other rows in both (a 9-row prefill chunk == those rows of the 12-row chunk)."""
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    monkeypatch.setenv("STRATA_QMATMUL_GEMM", variant)
    E, H, F, k, M = 6, 256, 64, 2, 12
    qts = (Q.Q2_K, Q.Q2_K, Q.IQ4_NL)
    (g, g64), (u, u64), (d, d64) = (_weight(rng, q, n, kk, (E,)) for q, n, kk in ((qts[0], F, H), (qts[1], F, H),
                                                                                   (qts[2], H, F)))
    x = rng.standard_normal((M, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int32)
    tw = rng.uniform(0.1, 1, (M, k)).astype(np.float32)
    want = np.zeros((M, H))
    for m in range(M):  # float64 SwiGLU experts
        for j in range(k):
            e = ids[m, j]
            a, b = g64[e] @ x[m], u64[e] @ x[m]
            want[m] += tw[m, j] * (d64[e] @ (a / (1 + np.exp(-a)) * b))
    args = (jnp.asarray(ids), jnp.asarray(tw), g, u, d, qts)
    # the window path (1e-5); the prefill path's grouped GEMM at its default, f16 (`gemm.DEFAULT_PRECISION`; the
    # unit kernel runs it as bf16x2), and at bf16x2 (test_grouped_experts: f16 3.6e-4, bf16x2 4e-6 .. 1.1e-5)
    ys = {}
    for prefill, prec, tol in ((False, None, 1e-5), (True, None, 2e-3), (True, "f16", 2e-3), (True, "bf16x2", 5e-5)):
        if prec is None:
            monkeypatch.delenv("STRATA_QMATMUL_PRECISION", raising=False)
        else:
            monkeypatch.setenv("STRATA_QMATMUL_PRECISION", prec)
        with dispatch.poison_outputs():
            y = ys[prefill, prec] = np.asarray(moe_experts(jnp.asarray(x), *args[:2], *args[2:], impl=impl,
                                                           prefill=prefill))
        assert np.max(np.abs(y - want)) <= tol * np.max(np.abs(want)), f"prefill={prefill} {prec or 'default'}"
        y9 = moe_experts(jnp.asarray(x[2:11]), args[0][2:11], args[1][2:11], *args[2:], impl=impl, prefill=prefill)
        assert_bits_equal(y9, y[2:11], f"prefill={prefill} {prec or 'default'}: 9 rows vs 12")
    # the default prefill GEMM is gemm.DEFAULT_PRECISION (f16; the unit kernel runs f16 as bf16x2)
    assert_bits_equal(ys[True, None], ys[True, "f16"], "prefill default vs STRATA_QMATMUL_PRECISION=f16")
    if variant == "kblock":
        assert np.any(ys[True, None] != ys[True, "bf16x2"]), "prefill default ran bf16x2"


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_k_split_independent_of_rows(impl, rng, monkeypatch, request):
    """The GEMV's K split is sized per weight and call site, never for the launch's slot count, which grows with
    the rows (8-row groups; an expert union over M rows): under a config whose split would follow it (16 target
    programs), a dense row has the bits of the row alone in 3 and in 12 rows (two groups), and a routed row the
    bits of the row alone beside 1 and 11 other rows (unions of 4 and 6 experts, k = 2)."""
    from strata_jax.pallas.grouped_experts import moe_experts
    cfg = gemv.Config(BN=16, G=1, target_programs=16)
    jax.clear_caches()   # the config is read when a call is traced
    request.addfinalizer(jax.clear_caches)
    monkeypatch.setattr(gemv, "choose_config", lambda *a: cfg)
    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    qtype, n_out, k_in = Q.Q8_0, 32, 256   # 2 tiles x 8 loop steps: 8 splits for 1 slot, 4 for 2, 2 for 4
    assert [gemv.tiling(qtype, n_out, k_in, cfg, per_unit=u)["split"] for u in (1, 2, 4)] == [8, 4, 2]
    w, w64 = _weight(rng, qtype, n_out, k_in)
    X = jnp.asarray(rng.standard_normal((12, k_in)).astype(np.float32))
    alone = np.asarray(qmatmul(X[:1], w, qtype, n_out, k_in, impl=impl))
    assert_bits_equal(np.asarray(qmatmul(X[:3], w, qtype, n_out, k_in, impl=impl))[:1], alone, "3 rows")
    assert_bits_equal(np.asarray(qmatmul(X, w, qtype, n_out, k_in, impl=impl, row_groups=True))[:1], alone,
                      "12 rows in 2 groups")
    f64_check(alone, np.asarray(X[:1]), w64, 1e-5, "dense")
    E, k = 6, 2
    (g, _), (u, _), (d, _) = (_weight(rng, qtype, n, kk, (E,)) for n, kk in ((n_out, k_in), (n_out, k_in),
                                                                            (k_in, n_out)))
    ids = np.asarray([[0, 1], [2, 3], [4, 5], [0, 2]] * 3, np.int32)
    tw = jnp.asarray(rng.uniform(0.1, 1, (12, k)).astype(np.float32))
    one = np.asarray(moe_experts(X[:1], jnp.asarray(ids[:1]), tw[:1], g, u, d, (qtype,) * 3, impl=impl))
    for M in (2, 3, 12):
        got = np.asarray(moe_experts(X[:M], jnp.asarray(ids[:M]), tw[:M], g, u, d, (qtype,) * 3, impl=impl))
        assert_bits_equal(got[:1], one, f"routed row beside {M - 1} rows")


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_ragged_k_splits(impl, rng):
    """K split into parts that do not divide the loop steps (the last split reads clamped steps and adds nothing):
    the planar GEMV (7 chunks in 3 splits), the tensor-core kernel (7 groups in 3 splits) and the tensor-core GEMV
    tc16 (7 steps in 3 splits) stay within 1e-5 of float64, outputs poisoned first."""
    from strata_jax.pallas.quant_matmul import gemv, tcgemv
    interpret = impl == "interpret"
    for k_in, qtype in ((7 * 256, Q.Q4_K), (7 * 32, Q.Q8_0)):
        w, w64 = _weight(rng, qtype, 16, k_in)
        x = rng.standard_normal((3, k_in)).astype(np.float32)
        cfg_v = gemv.Config(BN=16, G=8, target_programs=3)
        cfg_t = gemm.Config(BN=16, BM=16, target_programs=3)
        cfg_16 = tcgemv.Config(BN=16, G=8, target_programs=3)
        if k_in == 7 * 256:
            assert gemv.tiling(qtype, 16, k_in, cfg_v)["masked"]
        else:
            assert gemm.split_k(7, 1, 1, 3)["masked"]
        with dispatch.poison_outputs():
            y_v = gemv.gemv(jnp.asarray(x), w, qtype, 16, k_in, interpret=interpret, cfg=cfg_v)
            y_t = gemm.gemm(jnp.asarray(x), w, qtype, 16, k_in, interpret=interpret, cfg=cfg_t,
                            precision=gemm.PRECISE_PRECISION)
            y_16 = tcgemv.gemv(jnp.asarray(x), w, qtype, 16, k_in, interpret=interpret, cfg=cfg_16)
        assert tcgemv.tiling(qtype, 16, k_in, cfg_16)["masked"]
        f64_check(y_v, x, w64, 1e-5, f"GEMV {qtype.name} K={k_in}")
        f64_check(y_t, x, w64, 1e-5, f"tensor cores {qtype.name} K={k_in}")
        f64_check(y_16, x, w64, 1e-5, f"tc16 {qtype.name} K={k_in}")


def test_prepare_weight_rule(rng, monkeypatch):
    """prepare_weight repacks only under STRATA_QMATMUL=planar (the default) with the kernels in use; qmatmul's
    reference path gives a planar weight the values of its GGUF bytes; unknown variants raise."""
    raw = jnp.asarray(random_weight(rng, Q.Q4_K, 8, 256))
    x = jnp.asarray(rng.standard_normal((2, 256)).astype(np.float32))
    monkeypatch.setenv("STRATA_PALLAS_IMPL", "interpret")
    monkeypatch.setenv("STRATA_QMATMUL", "bytes")
    assert prepare_weight(raw, Q.Q4_K, 256) is raw
    monkeypatch.delenv("STRATA_QMATMUL", raising=False)
    p = prepare_weight(raw, Q.Q4_K, 256)
    assert p.dtype == jnp.uint32
    assert_bits_equal(qmatmul(x, p, Q.Q4_K, 8, 256, impl="reference"), qmatmul(x, raw, Q.Q4_K, 8, 256,
                                                                               impl="reference"), "reference")
    monkeypatch.setenv("STRATA_PALLAS_IMPL", "reference")
    assert prepare_weight(raw, Q.Q4_K, 256) is raw
    monkeypatch.setenv("STRATA_QMATMUL", "packed")
    with pytest.raises(UnsupportedError):
        prepare_weight(raw, Q.Q4_K, 256)


def test_embedding_rows_planar(rng, monkeypatch):
    """A planar embedding table (what a tied head holds) gathers and decodes rows to the GGUF bytes' values."""
    from strata_jax.layers.linear import Embedding
    raw = jnp.asarray(random_weight(rng, Q.Q6_K, 10, 256))
    ids = jnp.asarray([[3, 9, 0]], jnp.int32)
    want = Embedding(raw, Q.Q6_K, 10, 256)(ids)
    got = Embedding(planar.repack(raw, qtype=Q.Q6_K, n_cols=256), Q.Q6_K, 10, 256)(ids)
    assert_bits_equal(got, want, "embedding rows")


def test_tile_gemm_errors(rng):
    w = planar.repack(jnp.asarray(random_weight(rng, Q.Q8_0, 16, 64)), qtype=Q.Q8_0, n_cols=64)
    x = jnp.ones((4, 64), jnp.float32)
    with pytest.raises(UnsupportedError):
        gemm.tile_gemm(x, w[None], jnp.zeros((1,), jnp.int32), jnp.zeros((1, 8), jnp.int32), Q.Q8_0, 16, 64,
                       interpret=True)


def test_model_program_structure_planar(monkeypatch):
    """The fixture's prefill / step / window programs on the kernel path with planar weights (traced as on a GPU):
    planar kernels present, no XLA loop, no barrier, no copied weight operand (tests/pallas/test_program_structure.py
    checks the default path)."""
    from test_program_structure import _programs
    from strata_jax.pallas import structure

    monkeypatch.setenv("STRATA_QMATMUL", "planar")
    for kind, T, fn, args in _programs("kernel", monkeypatch):
        rep = structure.jaxpr_report(fn.trace(*args).jaxpr, [len(jax.tree.leaves(a)) for a in args])
        names = set(rep.kernels)
        assert any(n.startswith("qmatmul_planar_Q8_0") or n.startswith("qmatmul_tc_Q8_0") for n in names), names
        assert not rep.xla_while and not rep.xla_scan and rep.barriers == 0, (kind, rep.summary())
        assert not rep.sliced_operands, (kind, rep.sliced_operands)
