"""QSA: selection against a numpy implementation of the rule (ties to the lower index), attention against float64,
row independence, reference and kernel (interpret mode)."""

import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.errors import UnsupportedError
from strata_jax.pallas import dispatch
from strata_jax.pallas.qsa import block_scores, qsa_attention, select_blocks

from pallas_testlib import IMPLS, assert_bits_equal, assert_close_rel

HQ, HKV, D, HI, DI, BLOCK, TOP = 4, 2, 32, 2, 16, 4, 4


def make(rng, N, positions, dtype=np.float32, dup_blocks=False):
    T = len(positions)
    q = rng.standard_normal((T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((N, HKV, D)).astype(dtype)
    v = rng.standard_normal((N, HKV, D)).astype(dtype)
    iq = rng.standard_normal((T, HI, DI)).astype(np.float32)
    pooled = rng.standard_normal((N // BLOCK, DI)).astype(np.float32)
    if dup_blocks:  # equal scores: the lower block index must win
        pooled[5] = pooled[2]
        pooled[7] = pooled[2]
    n_kv = np.asarray(positions, np.int32) + 1
    n_complete = n_kv // BLOCK  # a block completed by the row's own token counts
    return [jnp.asarray(a) for a in (q, k, v, iq, pooled, n_kv, n_complete)]


def numpy_select(iq, pooled, n_complete, top):
    iq, pooled = np.asarray(iq, np.float64), np.asarray(pooled, np.float64)
    out = []
    for t in range(iq.shape[0]):
        s = np.maximum(iq[t] @ pooled.T, 0).sum(0)[: int(n_complete[t])]
        order = sorted(range(len(s)), key=lambda b: (-s[b], b))  # best first, ties to the lower index
        out.append(sorted(order[:top]))
    return out


def attention64(q, k, v, iq, pooled, n_kv, n_complete, top=TOP):
    q, k, v = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k, v))
    sel = numpy_select(iq, pooled, n_complete, top)
    G = HQ // HKV
    o = np.zeros(q.shape)
    for t in range(q.shape[0]):
        cells = [b * BLOCK + i for b in sel[t] for i in range(BLOCK)]
        cells += list(range(int(n_complete[t]) * BLOCK, int(n_kv[t])))
        for h in range(HQ):
            s = k[cells, h // G] @ q[t, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            o[t, h] = p @ v[cells, h // G] / p.sum()
    return o, sel


def test_selection_rule(rng):
    q, k, v, iq, pooled, n_kv, n_complete = make(rng, 48, [30, 37, 46, 47], dup_blocks=True)
    got = np.asarray(select_blocks(block_scores(iq, pooled), n_complete, TOP))
    want = numpy_select(iq, pooled, n_complete, TOP)
    for t in range(got.shape[0]):
        assert [int(b) for b in got[t] if b >= 0] == want[t], (t, got[t], want[t])
    # fewer complete blocks than the budget: all of them, then -1 padding
    few = np.asarray(select_blocks(block_scores(iq, pooled), jnp.asarray([2, 0, 4, 3], jnp.int32), TOP))
    assert few.tolist() == [[0, 1, -1, -1], [-1, -1, -1, -1], [0, 1, 2, 3], [0, 1, 2, -1]]


@pytest.mark.parametrize("impl", IMPLS)
def test_verify_rows_accuracy_and_exactness(impl, rng):
    positions = [41, 42, 43, 44, 45]  # a window crossing a block boundary, 10-11 complete blocks, top 4
    args = make(rng, 48, positions, dup_blocks=True)
    with dispatch.poison_outputs():
        o = qsa_attention(*args, top_blocks=TOP, block=BLOCK, impl=impl)
    assert o.shape == (len(positions), HQ, D) and o.dtype == jnp.float32
    want, _ = attention64(*args)
    assert_close_rel(o, want, 1e-5, f"{impl} qsa")
    q, k, v, iq, pooled, n_kv, n_complete = args
    for t in range(len(positions)):
        sl = slice(t, t + 1)
        o1 = qsa_attention(q[sl], k, v, iq[sl], pooled, n_kv[sl], n_complete[sl], top_blocks=TOP, block=BLOCK,
                           impl=impl)
        assert_bits_equal(o1[0], o[t], f"row {t} alone vs in the window")
    # other rows' contents do not matter
    q2, _, _, iq2, _, _, _ = make(rng, 48, positions)
    o2 = qsa_attention(q2.at[0].set(q[0]), k, v, iq2.at[0].set(iq[0]), pooled, n_kv, n_complete, top_blocks=TOP,
                       block=BLOCK, impl=impl)
    assert_bits_equal(o2[0], o[0], "row 0 with other neighbours")


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_block_causal_and_bf16(impl, rng):
    positions = list(range(0, 24))  # from an empty cache: n_complete <= TOP early (dense), sparse later
    args = make(rng, 24, positions, dtype=jnp.bfloat16)
    o = qsa_attention(*args, top_blocks=TOP, block=BLOCK, impl=impl)
    want, _ = attention64(*args)
    assert_close_rel(o, want, 1e-5, f"{impl} prefill (bf16 cache, f32 math)")
    q, k, v, *rest = args
    ob = qsa_attention(q.astype(jnp.bfloat16), k, v, *rest, top_blocks=TOP, block=BLOCK, impl=impl)
    assert_close_rel(ob, want, 1e-2, f"{impl} bf16 operands")


@pytest.mark.parametrize("impl", IMPLS)
def test_several_sequences_one_call(impl, rng):
    """Rows of two sequences in one call (flat caches, seg / cell_base) give each sequence's own call, bit for bit."""
    a = make(rng, 48, [41, 42, 43])
    b = make(rng, 48, [29, 30, 31])
    o_a = qsa_attention(*a, top_blocks=TOP, block=BLOCK, impl=impl)
    o_b = qsa_attention(*b, top_blocks=TOP, block=BLOCK, impl=impl)
    cat = lambda i: jnp.concatenate([a[i], b[i]])
    o = qsa_attention(cat(0), cat(1), cat(2), cat(3), jnp.stack([a[4], b[4]]), cat(5), cat(6), top_blocks=TOP,
                      block=BLOCK, seg=jnp.asarray([0, 0, 0, 1, 1, 1], jnp.int32),
                      cell_base=jnp.asarray([0, 0, 0, 48, 48, 48], jnp.int32), impl=impl)
    assert_bits_equal(o[:3], o_a, "sequence a")
    assert_bits_equal(o[3:], o_b, "sequence b")


def test_errors(rng):
    q, k, v, iq, pooled, n_kv, n_complete = make(rng, 16, [10, 11])
    with pytest.raises(UnsupportedError):
        qsa_attention(q[:, :3], k, v, iq, pooled, n_kv, n_complete)  # Hq=3 not a multiple of Hkv=2
    with pytest.raises(UnsupportedError):
        qsa_attention(q, k, v, iq, pooled, n_kv[:1], n_complete)
    with pytest.raises(UnsupportedError):
        qsa_attention(q, k[..., :24], v[..., :24], iq, pooled, n_kv, n_complete)


@pytest.mark.parametrize("window", [0, 5], ids=["causal", "sliding5"])
def test_dense_attention_kernel_path(window, rng, monkeypatch):
    """The dense attention layer on the kernel path (`strata_jax.layers.attention`, ``STRATA_PALLAS_IMPL=interpret``,
    compiled on a GPU: every row's causal cells listed for `attend_cells`): close to float64, a window of 3
    segments x 4 rows gives each row the bits of the row alone (B = 1, T = 1), whatever the other rows hold."""
    from strata_jax.layers.attention import attend_prefill, attend_window
    from strata_jax.state import Rows

    monkeypatch.setenv("STRATA_PALLAS_IMPL", "kernel" if "kernel" in IMPLS else "interpret")
    n_slots, mc, Hq, Hkv, Dh, T = 4, 40, 4, 2, 32, 4
    kc = jnp.asarray(rng.standard_normal((n_slots, mc + 1, Hkv, Dh)).astype(np.float32))
    vc = jnp.asarray(rng.standard_normal((n_slots, mc + 1, Hkv, Dh)).astype(np.float32))
    q = jnp.asarray(rng.standard_normal((3, T, Hq, Dh)).astype(np.float32))
    slots, pos0 = [2, 0, 3], [9, 30, 0]
    rows = Rows.make(slots, pos0, [T] * 3)
    o = attend_window(q, kc, vc, rows, scale=Dh ** -0.5, max_context=mc, window=window)
    G = Hq // Hkv
    for b in range(3):
        for t in range(T):
            p = pos0[b] + t
            cells = np.arange(mc + 1)
            ok = (cells <= p) & (cells < mc) & ((window <= 0) | (cells > p - window))
            K = np.asarray(kc[slots[b]], np.float64)[ok]
            V = np.asarray(vc[slots[b]], np.float64)[ok]
            for h in range(Hq):
                s = K[:, h // G] @ np.asarray(q[b, t, h], np.float64) * Dh ** -0.5
                e = np.exp(s - s.max())
                assert_close_rel(o[b, t, h], e @ V[:, h // G] / e.sum(), 1e-5, f"row ({b}, {t}) head {h}")
    for b, t in ((0, 0), (1, 3), (2, 2)):
        one = attend_window(q[b:b + 1, t:t + 1], kc, vc, Rows.make([slots[b]], [pos0[b] + t], [1]), scale=Dh ** -0.5,
                            max_context=mc, window=window)
        assert_bits_equal(one[0, 0], o[b, t], f"row ({b}, {t}) alone")
    # a prefill chunk of one segment: the same kernel, rows independent of the chunk's other rows
    pre = attend_prefill(q[1:2], kc, vc, Rows.make([0], [30], [T]), scale=Dh ** -0.5, max_context=mc, window=window)
    assert_bits_equal(pre, o[1:2], "prefill rows vs window rows")
