"""Gated delta rule: reference and kernel (interpret mode) against a float64 recurrence, plus the exactness
contract of the verify window (row t of a T-row window == the row alone on the committed state, bit for bit)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.errors import UnsupportedError
from strata_jax.pallas import dispatch
from strata_jax.pallas.gdn import gdn_chunked, gdn_commit, gdn_window

from pallas_testlib import IMPLS, assert_bits_equal, assert_close_rel

B, H, DK, DV = 2, 2, 16, 32


def make(rng, T, B=B, H=H, Dk=DK, Dv=DV, dtype=np.float32):
    def l2(x):
        return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
    S0 = rng.standard_normal((B, H, Dk, Dv)).astype(np.float32) * 0.5
    q = (l2(rng.standard_normal((B, T, H, Dk))) * Dk ** -0.5).astype(dtype)
    k = l2(rng.standard_normal((B, T, H, Dk))).astype(dtype)
    v = rng.standard_normal((B, T, H, Dv)).astype(dtype)
    g = -np.log1p(np.exp(rng.standard_normal((B, T, H)))).astype(np.float32)  # -softplus: log decay < 0
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    return [jnp.asarray(a) for a in (S0, q, k, v, g, beta)]


def recurrence64(S0, q, k, v, g, beta):
    S = np.asarray(S0, np.float64).copy()
    q, k, v, g, beta = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k, v, g, beta))
    T = q.shape[1]
    o = np.zeros(v.shape, np.float64)
    states = [S.copy()]
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None, None]
        kv = np.einsum("bhkv,bhk->bhv", S, k[:, t])
        delta = beta[:, t][..., None] * (v[:, t] - kv)
        S = S + k[:, t][..., :, None] * delta[..., None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
        states.append(S.copy())
    return o, states


@pytest.mark.parametrize("impl", IMPLS)
def test_window_and_commit_accuracy(impl, rng):
    S0, q, k, v, g, beta = make(rng, 8)
    o64, S64 = recurrence64(S0, q, k, v, g, beta)
    with dispatch.poison_outputs():
        o = gdn_window(S0, q, k, v, g, beta, impl=impl)
        n_keep = jnp.asarray([8, 5], jnp.int32)
        S = gdn_commit(S0, k, v, g, beta, n_keep, impl=impl)
    assert o.dtype == jnp.float32 and o.shape == (B, 8, H, DV)
    assert_close_rel(o, o64, 1e-5, "window o")
    assert_close_rel(S[0], S64[8][0], 1e-5, "commit S (n_keep=8)")
    assert_close_rel(S[1], S64[5][1], 1e-5, "commit S (n_keep=5)")


@pytest.mark.parametrize("impl", IMPLS)
def test_window_bf16_operands(impl, rng):
    S0, q, k, v, g, beta = make(rng, 4, dtype=jnp.bfloat16)
    o64, _ = recurrence64(S0, q, k, v, g, beta)
    o = gdn_window(S0, q, k, v, g, beta, impl=impl)
    assert_close_rel(o, o64, 1e-2, "bf16 window")


@pytest.mark.parametrize("impl", IMPLS)
def test_window_rows_exact(impl, rng):
    """o[:, t] == window(commit(S0, n_keep=t), row t alone), bit for bit; and rows > t do not matter."""
    T = 8
    S0, q, k, v, g, beta = make(rng, T)
    o = np.asarray(gdn_window(S0, q, k, v, g, beta, impl=impl))
    assert np.all(np.isfinite(o))
    for t in range(T):
        St = gdn_commit(S0, k, v, g, beta, jnp.full((B,), t, jnp.int32), impl=impl)
        sl = slice(t, t + 1)
        o1 = gdn_window(St, q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], impl=impl)
        assert_bits_equal(o1[:, 0], o[:, t], f"row {t} alone vs in window")
    # A T'-row window on the same prefix gives the same rows; junk in later rows changes nothing.
    _, q2, k2, v2, g2, b2 = make(rng, T)
    for Tp in (1, 3, 5):
        mix = lambda a, b: jnp.concatenate([a[:, :Tp], b[:, Tp:]], axis=1)
        om = gdn_window(S0, mix(q, q2), mix(k, k2), mix(v, v2), mix(g, g2), mix(beta, b2), impl=impl)
        assert_bits_equal(np.asarray(om)[:, :Tp], o[:, :Tp], f"prefix {Tp} with other later rows")
        op = gdn_window(S0, q[:, :Tp], k[:, :Tp], v[:, :Tp], g[:, :Tp], beta[:, :Tp], impl=impl)
        assert_bits_equal(op, o[:, :Tp], f"T={Tp} window vs T=8 prefix")


@pytest.mark.parametrize("impl", IMPLS)
def test_window_segments_independent(impl, rng):
    """Segment 0's window output and committed state have the bits of the segment alone whatever the number of
    segments B (1..4) in the call: the reference path's sums over Dk are fixed trees (XLA's reduce had ordered them by
    B: 143 of 192 outputs differed at 6 heads of 32 x 32)."""
    Bmax, Hh, Dk, Dv = 4, 6, 32, 32
    S0, q, k, v, g, beta = make(rng, 1, B=Bmax, H=Hh, Dk=Dk, Dv=Dv)

    def run(B):
        sl = jnp.arange(B, dtype=jnp.int32)
        o = gdn_window(S0, q[:B], k[:B], v[:B], g[:B], beta[:B], slots=sl, impl=impl)
        S1 = gdn_commit(S0, k[:B], v[:B], g[:B], beta[:B], jnp.ones((B,), jnp.int32), slots=sl, impl=impl)
        return o[0], S1[0]

    o1, s1 = run(1)
    for B in (2, 3, 4):
        oB, sB = run(B)
        assert_bits_equal(oB, o1, f"window output, {B} segments")
        assert_bits_equal(sB, s1, f"committed state, {B} segments")


@pytest.mark.parametrize("impl", IMPLS)
def test_commit_equals_successive_single_commits(impl, rng):
    T = 8
    S0, q, k, v, g, beta = make(rng, T)
    S = S0
    n = jnp.ones((B,), jnp.int32)
    for t in range(T + 1):
        Sc = gdn_commit(S0, k, v, g, beta, jnp.full((B,), t, jnp.int32), impl=impl)
        assert_bits_equal(Sc, S, f"commit n_keep={t} vs {t} single-row commits")
        if t < T:
            sl = slice(t, t + 1)
            S = gdn_commit(S, k[:, sl], v[:, sl], g[:, sl], beta[:, sl], n, impl=impl)
    # per-segment n_keep, S0 is returned unchanged for n_keep=0
    Sm = gdn_commit(S0, k, v, g, beta, jnp.asarray([0, 3], jnp.int32), impl=impl)
    assert_bits_equal(Sm[0], S0[0], "n_keep=0")
    S3 = gdn_commit(S0, k, v, g, beta, jnp.full((B,), 3, jnp.int32), impl=impl)
    assert_bits_equal(Sm[1], S3[1], "segments independent")


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_prefill(impl, rng):
    T = 70  # crosses the 64-row chunk boundary of the reference
    S0, q, k, v, g, beta = make(rng, T, B=1)
    o64, S64 = recurrence64(S0, q, k, v, g, beta)
    with dispatch.poison_outputs():
        o, S = gdn_chunked(S0, q, k, v, g, beta, impl=impl)
    assert o.shape == (1, T, H, DV) and S.shape == S0.shape
    assert_close_rel(o, o64, 1e-5, "chunked o")
    assert_close_rel(S, S64[-1], 1e-5, "chunked S_T")


@pytest.mark.parametrize("impl", IMPLS)
def test_slots_in_place(impl, rng):
    """With ``slots``, the ops read segment b's state from ``S0[slots[b]]`` of every slot's state and commit /
    prefill return every slot's state with those slots replaced (in place on the kernel path): the same bits as
    the per-segment call, the other slots untouched."""
    S0, q, k, v, g, beta = make(rng, 4)
    N = 5
    S_all = jnp.asarray(rng.standard_normal((N, H, DK, DV)).astype(np.float32)) * 0.5
    slots = jnp.asarray([3, 1], jnp.int32)
    S_all = S_all.at[slots].set(S0)
    others = [i for i in range(N) if i not in (1, 3)]
    n_keep = jnp.asarray([2, 4], jnp.int32)
    with dispatch.poison_outputs():
        o = gdn_window(S_all, q, k, v, g, beta, slots=slots, impl=impl)
        S_c = gdn_commit(S_all, k, v, g, beta, n_keep, slots=slots, impl=impl)
        o_p, S_p = gdn_chunked(S_all, q, k, v, g, beta, slots=slots, impl=impl)
    assert_bits_equal(o, gdn_window(S0, q, k, v, g, beta, impl=impl), "window with slots")
    assert_bits_equal(S_c[slots], gdn_commit(S0, k, v, g, beta, n_keep, impl=impl), "commit with slots")
    o1, S1 = gdn_chunked(S0, q, k, v, g, beta, impl=impl)
    assert_bits_equal(o_p, o1, "prefill o with slots")
    assert_bits_equal(S_p[slots], S1, "prefill S with slots")
    for S in (S_c, S_p):
        assert_bits_equal(S[jnp.asarray(others)], S_all[jnp.asarray(others)], "other slots untouched")


def test_errors_and_auto(rng):
    S0, q, k, v, g, beta = make(rng, 9)
    with pytest.raises(UnsupportedError):
        gdn_window(S0, q, k, v, g, beta)
    S0, q, k, v, g, beta = make(rng, 2, Dk=12, Dv=16)
    with pytest.raises(UnsupportedError):
        gdn_window(S0, q, k, v, g, beta, impl="interpret")  # Dk=12: not a power of two
    with pytest.raises(UnsupportedError):
        gdn_window(S0, q, k, v, g, beta, impl="bogus")
    o = gdn_window(S0, q, k, v, g, beta)  # auto on CPU: the reference
    assert o.shape == (B, 2, H, 16)
    if jax.default_backend() == "cpu":
        with pytest.raises(UnsupportedError):
            gdn_window(*make(rng, 2), impl="kernel")


# --- the chunked prefill kernel (`strata_jax.pallas.gdn.chunked`) ----------------------------------------------------

KERNEL_IMPLS = [i for i in IMPLS if i != "reference"]


@pytest.mark.parametrize("T", [1, 37, 130])  # one row; less than a chunk; three chunks, the last one ragged
def test_chunked_kernel_slots_accuracy(T, rng):
    """B=2 segments in slots 3 and 0 of 4: o and the slots' final states within 1e-5 of a float64 recurrence;
    the other slots keep their bits. Dv=64: two value-column tiles."""
    Dv = 64
    S0, q, k, v, g, beta = make(rng, T, Dv=Dv)
    S_all = jnp.asarray(rng.standard_normal((4, H, DK, Dv)).astype(np.float32))
    slots = jnp.asarray([3, 0], jnp.int32)
    S_all = S_all.at[slots].set(S0)
    o64, S64 = recurrence64(S0, q, k, v, g, beta)
    for impl in KERNEL_IMPLS:
        with dispatch.poison_outputs():
            o, S = gdn_chunked(S_all, q, k, v, g, beta, slots=slots, impl=impl)
        assert o.dtype == jnp.float32 and o.shape == (B, T, H, Dv) and S.shape == S_all.shape
        assert_close_rel(o, o64, 1e-5, f"{impl} T={T} o")
        assert_close_rel(S[slots], S64[-1], 1e-5, f"{impl} T={T} S_T")
        assert_bits_equal(S[jnp.asarray([1, 2])], S_all[jnp.asarray([1, 2])], f"{impl} other slots")


def test_chunked_kernel_bf16_operands(rng):
    S0, q, k, v, g, beta = make(rng, 70, B=1, dtype=jnp.bfloat16)
    o64, S64 = recurrence64(S0, q, k, v, g, beta)
    for impl in KERNEL_IMPLS:
        o, S = gdn_chunked(S0, q, k, v, g, beta, impl=impl)
        assert_close_rel(o, o64, 1e-5, f"{impl} bf16 o")  # the operands are exact in f32: same accuracy
        assert_close_rel(S, S64[-1], 1e-5, f"{impl} bf16 S_T")


def test_chunked_kernel_row_invariance(rng):
    """A segment's outputs and state are the same bits alone (B=1) as beside another segment (B=2, either
    order), and its first T' rows' outputs do not depend on the rows after them (T' = 37 inside the first chunk,
    T' = 64 one full chunk, of T = 130), nor does the state after T' rows differ from a T'-row call's."""
    T = 130
    S0, q, k, v, g, beta = make(rng, T)
    for impl in KERNEL_IMPLS:
        o2, S2 = gdn_chunked(S0, q, k, v, g, beta, impl=impl)
        o21, S21 = gdn_chunked(S0[::-1], q[::-1], k[::-1], v[::-1], g[::-1], beta[::-1], impl=impl)
        for b in range(B):
            sl = slice(b, b + 1)
            o1, S1 = gdn_chunked(S0[sl], q[sl], k[sl], v[sl], g[sl], beta[sl], impl=impl)
            assert_bits_equal(o1[0], o2[b], f"{impl} segment {b} o alone vs with another")
            assert_bits_equal(S1[0], S2[b], f"{impl} segment {b} S alone vs with another")
            assert_bits_equal(o1[0], o21[B - 1 - b], f"{impl} segment {b} o as the other segment")
            assert_bits_equal(S1[0], S21[B - 1 - b], f"{impl} segment {b} S as the other segment")
        for Tp in (37, 64):
            op, Sp = gdn_chunked(S0, q[:, :Tp], k[:, :Tp], v[:, :Tp], g[:, :Tp], beta[:, :Tp], impl=impl)
            assert_bits_equal(op, o2[:, :Tp], f"{impl} T={Tp} call vs the first {Tp} rows of T={T}")
            # the state: continuing from it gives the T-row call's last rows to ~1e-5 (a different chunking)
            oc, Sc = gdn_chunked(Sp, q[:, Tp:], k[:, Tp:], v[:, Tp:], g[:, Tp:], beta[:, Tp:], impl=impl)
            assert_close_rel(oc, o2[:, Tp:], 1e-5, f"{impl} rows after T'={Tp} from the T'-row state")
            assert_close_rel(Sc, S2, 1e-5, f"{impl} state via T'={Tp}")


@pytest.mark.skipif("kernel" not in IMPLS, reason="the compiled kernel at the models' shapes needs a GPU")
def test_chunked_kernel_model_shapes(rng):
    """Qwen3.6 / Qwen3.8-Flash-Next GDN shapes (H=32 v-heads, Dk=Dv=128; configs/geometries), bf16 operands,
    a ragged last chunk, two segments in slots."""
    T, Hm, D = 300, 32, 128
    S0, q, k, v, g, beta = make(rng, T, B=2, H=Hm, Dk=D, Dv=D, dtype=jnp.bfloat16)
    S_all = jnp.zeros((3, Hm, D, D), jnp.float32).at[jnp.asarray([2, 0])].set(S0)
    o64, S64 = recurrence64(S0, q, k, v, g, beta)
    with dispatch.poison_outputs():
        o, S = gdn_chunked(S_all, q, k, v, g, beta, slots=jnp.asarray([2, 0], jnp.int32), impl="kernel")
    assert_close_rel(o, o64, 1e-5, "o")
    assert_close_rel(S[jnp.asarray([2, 0])], S64[-1], 1e-5, "S_T")
    assert_bits_equal(S[1], S_all[1], "slot 1 untouched")


@pytest.mark.parametrize("launch", [{}, {"BV": 16, "BV_out": 16}, {"num_warps": 8, "out_warps": 8},
                                    {"state_stages": 2}], ids=["default", "tiles16", "warps8", "stages2"])
def test_chunked_kernel_launch_settings(launch, rng):
    """The chunked kernel at several launch settings (value tiles, warps, pipelining stages; bench_kernels'
    gdn_prefill variants): within 1e-5 of a float64 recurrence over three chunks (the last one ragged), and the
    first 37 rows' outputs are the same bits as a 37-row call's (a row does not depend on later rows, nor on T).
    The settings' bits are not compared with each other (the value tiles change them; warps and stages only exist
    compiled: in interpret mode those two cases repeat the default)."""
    from strata_jax.pallas.gdn import chunked

    interpret = "kernel" not in IMPLS
    T, Dv = 130, 64
    S0, q, k, v, g, beta = make(rng, T, Dv=Dv)
    slot = jnp.arange(B, dtype=jnp.int32)
    run = jax.jit(lambda *a: chunked.gdn_chunked_kernel(slot, *a, interpret=interpret, **launch))
    o, S = run(S0, q, k, v, g, beta)
    o64, S64 = recurrence64(S0, q, k, v, g, beta)
    assert_close_rel(o, o64, 1e-5, f"{launch} o")
    assert_close_rel(S, S64[-1], 1e-5, f"{launch} S_T")
    o37, _ = run(S0, q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37])
    assert_bits_equal(o37, o[:, :37], f"{launch} 37 rows vs the first 37 of 130")


def test_chunked_kernel_bad_tile(rng):
    from strata_jax.pallas.gdn import chunked

    slot, args = jnp.arange(B, dtype=jnp.int32), make(rng, 4)
    with pytest.raises(ValueError, match="BV_out=24"):   # DV = 32: a tile of 24 would leave columns unwritten
        chunked.gdn_chunked_kernel(slot, *args, interpret=True, BV_out=24)
    with pytest.raises(ValueError, match="BV=8"):
        chunked.gdn_chunked_kernel(slot, *args, interpret=True, BV=8)
    o, _ = chunked.gdn_chunked_kernel(slot, *args, interpret=True, C=40)   # any chunk length
    assert o.shape == (B, 4, H, DV)
