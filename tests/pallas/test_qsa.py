"""QSA: selection against a numpy implementation of the rule (ties to the lower index), attention against float64,
row independence, reference and kernel (interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.errors import UnsupportedError
from strata_jax.pallas import dispatch
from strata_jax.pallas.qsa import attend_range, block_scores, qsa_attention, qsa_prefill, select_blocks

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
    Hq, Dh = q.shape[1:]
    G = Hq // k.shape[1]
    o = np.zeros(q.shape)
    for t in range(q.shape[0]):
        cells = [b * BLOCK + i for b in sel[t] for i in range(BLOCK)]
        cells += list(range(int(n_complete[t]) * BLOCK, int(n_kv[t])))
        for h in range(Hq):
            s = k[cells, h // G] @ q[t, h] / np.sqrt(Dh)
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


# --- prefill chunks (`qsa_prefill`): B segments of T rows at consecutive positions ----------------------------------
PD, PDI, PTOP, PN = 64, 32, 8, 256   # head dim, indexer head dim, blocks kept of the 64 a full slot holds, cells


def make_prefill(rng, T, pos0, dtype=np.float32):
    """Segment b holds the rows pos0[b] .. pos0[b]+T-1 of slot b (cells b*PN .. b*PN+PN-1 of the flat caches).

    The indexer inputs are multiples of 1/4 in [-3/4, 3/4]: every score is exact in float32 and float64 alike (so
    the float64 selection is the kernel's), and equal scores are common (ties to the lower block index)."""
    B = len(pos0)
    q = rng.standard_normal((B, T, HQ, PD)).astype(np.float32)
    k = rng.standard_normal((B * PN, HKV, PD)).astype(dtype)
    v = rng.standard_normal((B * PN, HKV, PD)).astype(dtype)
    iq = (rng.integers(-3, 4, (B, T, HI, PDI)) / 4).astype(np.float32)
    pooled = (rng.integers(-3, 4, (B, PN // BLOCK, PDI)) / 4).astype(np.float32)
    n_kv = np.asarray(pos0, np.int32)[:, None] + np.arange(1, T + 1, dtype=np.int32)
    n_complete = n_kv // BLOCK
    base = np.arange(B, dtype=np.int32) * PN
    return [jnp.asarray(a) for a in (q, k, v, iq, pooled, n_kv, n_complete)], jnp.asarray(base)


def prefill64(args, base):
    q, k, v, iq, pooled, n_kv, n_complete = args
    out, n_ties = [], 0
    for b in range(q.shape[0]):
        cells = slice(int(base[b]), int(base[b]) + PN)
        o, _ = attention64(q[b], k[cells], v[cells], iq[b], pooled[b], n_kv[b], n_complete[b], top=PTOP)
        out.append(o)
        sc = np.maximum(np.asarray(iq[b], np.float64) @ np.asarray(pooled[b], np.float64).T, 0).sum(1)
        for t in range(q.shape[1]):  # rows where the cut at the PTOP-th best block falls inside a tie
            s = np.sort(sc[t, : int(n_complete[b, t])])[::-1]
            n_ties += int(len(s) > PTOP and s[PTOP - 1] == s[PTOP])
    return np.stack(out), n_ties


# (impl, STRATA_QSA_PREFILL): the reference once, each kernel path (`api.prefill_variant`) per compiled impl
PREFILL_PATHS = [("reference", "rows")] + [(i, v) for i in IMPLS if i != "reference" for v in ("rows", "tiles")]
PREFILL_IDS = [i if i == "reference" else f"{i}-{v}" for i, v in PREFILL_PATHS]


@pytest.fixture
def prefill_path(request, monkeypatch):
    impl, variant = request.param
    monkeypatch.setenv("STRATA_QSA_PREFILL", variant)
    return impl


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("prefill_path", PREFILL_PATHS, ids=PREFILL_IDS, indirect=True)
def test_prefill_accuracy(prefill_path, dtype, rng):
    """Two segments: one from an empty cache (dense until 8 blocks complete, then sparse), one ending near its
    slot's end (the selection keeps 8 of 60 blocks); against float64, with ties at the selection's cut. Each
    kernel path of `qsa_prefill` (``STRATA_QSA_PREFILL`` rows / tiles)."""
    impl = prefill_path
    T = 40
    args, base = make_prefill(rng, T, [0, PN - T - 3], dtype)
    with dispatch.poison_outputs():
        o = qsa_prefill(*args, top_blocks=PTOP, block=BLOCK, cell_base=base, impl=impl)
    assert o.shape == (2, T, HQ, PD) and o.dtype == jnp.float32
    want, n_ties = prefill64(args, base)
    assert n_ties > 0, "no tie at the selection's cut: the inputs do not test the tie rule"
    assert_close_rel(o, want, 1e-5, f"{impl} prefill ({np.dtype(dtype).name} cache)")


@pytest.mark.parametrize("prefill_path", PREFILL_PATHS, ids=PREFILL_IDS, indirect=True)
def test_prefill_rows_independent(prefill_path, rng):
    """A row's bits do not depend on the chunk's row count, its place in the chunk, padding rows, the other rows'
    contents or the other segments: T = 48 rows vs the last 16 alone, vs the first 40, vs the last 37, vs 64 rows
    (16 other rows at the end), vs other neighbours, vs its segment alone."""
    impl = prefill_path
    T = 48
    (q, k, v, iq, pooled, n_kv, nc), base = make_prefill(rng, T, [150, 30])
    call = lambda q, iq, pooled, n_kv, nc, base: qsa_prefill(q, k, v, iq, pooled, n_kv, nc, top_blocks=PTOP,
                                                            block=BLOCK, cell_base=base, impl=impl)
    o = call(q, iq, pooled, n_kv, nc, base)
    last = call(q[:, 32:], iq[:, 32:], pooled, n_kv[:, 32:], nc[:, 32:], base)
    assert_bits_equal(last, o[:, 32:], "the last 16 rows alone")
    first = call(q[:, :40], iq[:, :40], pooled, n_kv[:, :40], nc[:, :40], base)
    assert_bits_equal(first, o[:, :40], "the first 40 rows")
    mid = call(q[:, 11:], iq[:, 11:], pooled, n_kv[:, 11:], nc[:, 11:], base)  # other places in the row tiles
    assert_bits_equal(mid, o[:, 11:], "rows 11..47")
    (q2, _, _, iq2, _, n_kv2, nc2), _ = make_prefill(rng, 64, [150 - 16, 30 - 16])
    pad = lambda a, a2: jnp.concatenate([a, a2[:, :16]], axis=1)
    padded = call(pad(q, q2), pad(iq, iq2), pooled, pad(n_kv, n_kv2), pad(nc, nc2), base)
    assert_bits_equal(padded[:, :T], o, "48 rows + 16 other rows at the end")
    mixed = call(q2[:, :T].at[:, 5].set(q[:, 5]), iq2[:, :T].at[:, 5].set(iq[:, 5]), pooled, n_kv, nc, base)
    assert_bits_equal(mixed[:, 5], o[:, 5], "row 5 with other neighbours")
    one = call(q[1:], iq[1:], pooled[1:], n_kv[1:], nc[1:], base[1:])
    assert_bits_equal(one, o[1:], "segment 1 alone")


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "reference"])
def test_prefill_rows_path_slices(impl, rng, monkeypatch):
    """The ``rows`` path cuts the B*T rows into slices of `api.PREFILL_ROWS` (bounded partial sums): slices of 16
    rows (2 x 44 rows: 6 slices, one across the segments' boundary, the last short) give the bits of one slice; the
    slice size reaches the compiled function (a new program)."""
    from strata_jax.pallas.qsa import api

    monkeypatch.setenv("STRATA_QSA_PREFILL", "rows")
    args, base = make_prefill(rng, 44, [0, 150])
    whole = qsa_prefill(*args, top_blocks=PTOP, block=BLOCK, cell_base=base, impl=impl)
    n_programs = api._qsa_prefill._cache_size()
    monkeypatch.setattr(api, "PREFILL_ROWS", 16)
    sliced = qsa_prefill(*args, top_blocks=PTOP, block=BLOCK, cell_base=base, impl=impl)
    assert api._qsa_prefill._cache_size() == n_programs + 1, "the slice size did not reach the jitted function"
    assert_bits_equal(sliced, whole, "slices of 16 rows")
    want, _ = prefill64(args, base)
    assert_close_rel(sliced, want, 1e-5, f"{impl} rows path in slices")


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "reference"])
def test_prefill_tilings(impl, rng):
    """Other tilings of the attention kernel (`prefill.tiling`: 16 (row, head) pairs x key tiles of 16 cells, 4
    blocks per tile word; 32 pairs x 32 cells, the D = 256 default) are as close to float64, and row independent."""
    from strata_jax.pallas.qsa import prefill as P

    T = 24
    (q, k, v, iq, pooled, n_kv, nc), base = make_prefill(rng, T, [PN - T - 1])
    want, _ = prefill64((q, k, v, iq, pooled, n_kv, nc), base)
    for m_tile, tk in ((16, 16), (32, 32)):
        run = lambda sl: P.qsa_prefill_kernel(q[:, sl], k, v, iq[:, sl], pooled, n_kv[:, sl], nc[:, sl], base,
                                              top_blocks=PTOP, block=BLOCK, scale=PD ** -0.5,
                                              interpret=impl == "interpret", m_tile=m_tile, tk=tk)
        o = run(slice(None))
        assert_close_rel(o, want, 1e-5, f"{impl} m_tile={m_tile} tk={tk}")
        assert_bits_equal(run(slice(5, None)), o[:, 5:], f"m_tile={m_tile} tk={tk}: rows 5.. alone")


def test_prefill_tile_words():
    """The block bits per key tile and the live key tiles of each query tile (`prefill.tile_words`,
    `prefill.live_tiles`) on a hand-made selection: tiles of 8 cells = 2 blocks of 4."""
    from strata_jax.pallas.qsa import prefill as P

    blocks = jnp.asarray([[0, 3, 6, -1], [1, -1, -1, -1], [-1, -1, -1, -1], [2, 3, -1, -1]], jnp.int32)
    words = P.tile_words(blocks, 4, 8, 4)
    assert np.asarray(words).tolist() == [[1, 2, 0, 1], [2, 0, 0, 0], [0, 0, 0, 0], [0, 3, 0, 0]]
    n_complete = jnp.asarray([7, 2, 0, 5], jnp.int32)
    n_kv = jnp.asarray([30, 10, 0, 23], jnp.int32)  # tails: cells 28-29 (tile 3), 8-9 (tile 1), none, 20-22 (tile 2)
    live = P.live_tiles(words, n_kv, n_complete, rows_per_tile=2, tk=8, block=4)
    assert np.asarray(live).tolist() == [[1, 1, 0, 1], [0, 1, 1, 0]]


def test_prefill_errors(rng):
    (q, k, v, iq, pooled, n_kv, nc), base = make_prefill(rng, 8, [20])
    with pytest.raises(UnsupportedError):
        qsa_prefill(q[0], k, v, iq[0], pooled[0], n_kv[0], nc[0])  # rows without the segment axis
    with pytest.raises(UnsupportedError):
        qsa_prefill(q, k, v, iq, pooled, n_kv[:, :4], nc)
    with pytest.raises(UnsupportedError):
        qsa_prefill(q, k, v, iq, pooled, n_kv, nc, cell_base=jnp.zeros((2,), jnp.int32))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STRATA_QSA_PREFILL", "tiles")
        with pytest.raises(UnsupportedError, match="block 3"):
            qsa_prefill(q, k, v, iq, pooled, n_kv, nc, block=3, impl="interpret")  # tiles: block a power of two
        mp.setenv("STRATA_QSA_PREFILL", "blocks")
        with pytest.raises(UnsupportedError, match="STRATA_QSA_PREFILL"):
            qsa_prefill(q, k, v, iq, pooled, n_kv, nc, impl="interpret")
        # the reference does not read it
        assert qsa_prefill(q, k, v, iq, pooled, n_kv, nc, top_blocks=PTOP, block=BLOCK,
                           impl="reference").shape == q.shape
        # the rows path takes any block size: blocks of 3 as the reference computes them
        mp.setenv("STRATA_QSA_PREFILL", "rows")
        pooled3 = pooled[:, : PN // 3]
        got = qsa_prefill(q, k, v, iq, pooled3, n_kv, n_kv // 3, top_blocks=PTOP, block=3, impl="interpret")
        want = qsa_prefill(q, k, v, iq, pooled3, n_kv, n_kv // 3, top_blocks=PTOP, block=3, impl="reference")
        assert_close_rel(got, want, 1e-5, "rows path, blocks of 3")


@pytest.mark.parametrize("window", [0, 5], ids=["causal", "sliding5"])
def test_dense_attention_kernel_path(window, rng, monkeypatch):
    """The dense attention layer on the kernel path (`strata_jax.layers.attention`, ``STRATA_PALLAS_IMPL=interpret``,
    compiled on a GPU). Verify windows (every row's causal cells listed for `attend_cells`): close to float64, a
    window of 3 segments x 4 rows gives each row the bits of the row alone (B = 1, T = 1), whatever the other rows
    hold. Prefill chunks (`attend_range`, tensor-core tiles): close to float64, a row's bits the same in a chunk of
    3 segments x 4 rows and in a 2-row chunk of its own segment."""
    from strata_jax.layers.attention import attend_prefill, attend_window
    from strata_jax.state import Rows

    monkeypatch.setenv("STRATA_PALLAS_IMPL", "kernel" if "kernel" in IMPLS else "interpret")
    n_slots, mc, Hq, Hkv, Dh, T = 4, 40, 4, 2, 32, 4
    kc = jnp.asarray(rng.standard_normal((n_slots, mc + 1, Hkv, Dh)).astype(np.float32))
    vc = jnp.asarray(rng.standard_normal((n_slots, mc + 1, Hkv, Dh)).astype(np.float32))
    q = jnp.asarray(rng.standard_normal((3, T, Hq, Dh)).astype(np.float32))
    slots, pos0 = [2, 0, 3], [9, 30, 0]
    rows = Rows.make(slots, pos0, [T] * 3)
    G = Hq // Hkv

    def check64(o, what):
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
                    assert_close_rel(o[b, t, h], e @ V[:, h // G] / e.sum(), 1e-5, f"{what} row ({b}, {t}) head {h}")

    o = attend_window(q, kc, vc, rows, scale=Dh ** -0.5, max_context=mc, window=window)
    check64(o, "window")
    for b, t in ((0, 0), (1, 3), (2, 2)):
        one = attend_window(q[b:b + 1, t:t + 1], kc, vc, Rows.make([slots[b]], [pos0[b] + t], [1]), scale=Dh ** -0.5,
                            max_context=mc, window=window)
        assert_bits_equal(one[0, 0], o[b, t], f"row ({b}, {t}) alone")
    pre = attend_prefill(q, kc, vc, rows, scale=Dh ** -0.5, max_context=mc, window=window)
    check64(pre, "prefill")
    part = attend_prefill(q[1:2, 2:], kc, vc, Rows.make([0], [32], [2]), scale=Dh ** -0.5, max_context=mc,
                          window=window)
    assert_bits_equal(part[0], pre[1, 2:], "prefill rows 2..3 of segment 1 alone")


def test_dense_attention_reference_rows_independent_of_batch(rng, monkeypatch):
    """The reference path (XLA on a CPU) of a verify / batch window: a row of segment 0 gets the bits of the row
    alone (B = 1, T = 1) in windows of 1..4 segments x 1..8 rows, at a cache length where XLA:CPU's vectorisation
    by the whole array's size changed them (257 cells, 12 / 2 heads of 128: 120 of 1,536 outputs differed at B >= 2
    when the segments shared one softmax op)."""
    from strata_jax.layers.attention import attend_window
    from strata_jax.state import Rows

    monkeypatch.setenv("STRATA_PALLAS_IMPL", "reference")
    n_slots, mc, Hq, Hkv, Dh = 4, 256, 12, 2, 128
    kc = jnp.asarray(rng.standard_normal((n_slots, mc + 1, Hkv, Dh)).astype(np.float32))
    vc = jnp.asarray(rng.standard_normal((n_slots, mc + 1, Hkv, Dh)).astype(np.float32))
    q = jnp.asarray(rng.standard_normal((4, 8, Hq, Dh)).astype(np.float32))
    pos0 = np.asarray([40, 50, 60, 70], np.int32)
    f = jax.jit(lambda q, slot, p0, nv: attend_window(q, kc, vc, Rows(slot, p0, nv), scale=Dh ** -0.5,
                                                       max_context=mc))
    solo = f(q[:1, :1], jnp.asarray([0], jnp.int32), jnp.asarray(pos0[:1]), jnp.asarray([1], jnp.int32))[0, 0]
    for B, T in ((1, 4), (2, 1), (3, 4), (4, 8)):
        o = f(q[:B, :T], jnp.arange(B, dtype=jnp.int32), jnp.asarray(pos0[:B]), jnp.full((B,), T, jnp.int32))
        assert_bits_equal(o[0, 0], solo, f"row (0, 0) in {B} segments x {T} rows")


@pytest.mark.parametrize("impl", IMPLS)
def test_attend_range_segments_and_errors(impl, rng):
    """attend_range over two segments of one flat cache (the second with a sliding lower bound, rows past 64 cells:
    several key tiles, some skipped): close to float64; a bad shape raises."""
    B, T, S = 2, 24, 150
    k = jnp.asarray(rng.standard_normal((B * S, HKV, D)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((B * S, HKV, D)).astype(np.float32))
    q = jnp.asarray(rng.standard_normal((B, T, HQ, D)).astype(np.float32))
    pos = np.stack([np.arange(T) + 3, np.arange(T) + 110])
    hi = pos + 1
    lo = np.stack([np.zeros(T, np.int64), np.maximum(0, pos[1] - 70)])
    base = np.asarray([0, S], np.int32)
    with dispatch.poison_outputs():
        o = attend_range(q, k, v, jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32), jnp.asarray(base),
                         n_cells=S, impl=impl)
    k64, v64, q64 = (np.asarray(a, np.float64) for a in (k, v, q))
    G = HQ // HKV
    want = np.zeros(q.shape)
    for b in range(B):
        for t in range(T):
            cells = base[b] + np.arange(lo[b, t], hi[b, t])
            for h in range(HQ):
                s = k64[cells, h // G] @ q64[b, t, h] / np.sqrt(D)
                e = np.exp(s - s.max())
                want[b, t, h] = e @ v64[cells, h // G] / e.sum()
    assert_close_rel(o, want, 1e-5, f"{impl} attend_range")
    with pytest.raises(UnsupportedError):
        attend_range(q, k, v, jnp.asarray(lo[:, :3], jnp.int32), jnp.asarray(hi, jnp.int32), jnp.asarray(base),
                     n_cells=S, impl=impl)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "reference"])  # the kernel's own configs
def test_attend_launch_configs(impl, rng):
    """The decode attention under the launch configs `choose_attend_config` picks (16 / 32-cell steps, up to 128
    splits, 8 warps) and with the head dim in slices (DC): close to float64 over lists of scattered cells and -1
    padding, and a row's bits the same alone and beside another row, outputs poisoned first."""
    from strata_jax.pallas.qsa import kernel as K

    T, Hq, Hkv, Dh, N, L = 3, 6, 2, 64, 300, 150
    q = jnp.asarray(rng.standard_normal((T, Hq, Dh)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((N, Hkv, Dh)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((N, Hkv, Dh)).astype(np.float32))
    cells = np.full((T, L), -1, np.int32)
    for t, n in enumerate((150, 37, 90)):
        cells[t, :n] = np.sort(rng.choice(N, n, replace=False))
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    want = np.zeros(q.shape)
    for t in range(T):
        c = cells[t][cells[t] >= 0]
        for h in range(Hq):
            s = k64[c, h // (Hq // Hkv)] @ q64[t, h] / np.sqrt(Dh)
            e = np.exp(s - s.max())
            want[t, h] = e @ v64[c, h // (Hq // Hkv)] / e.sum()
    interpret = impl == "interpret"
    for cfg in (K.choose_attend_config(Dh, L), K.AttendConfig(NC=32, max_split=128, num_warps=8),
                K.AttendConfig(NC=16, max_split=4, DC=16)):
        with dispatch.poison_outputs():
            o = K.attend_kernel(q, k, v, jnp.asarray(cells), Dh ** -0.5, interpret=interpret, cfg=cfg)
            one = K.attend_kernel(q[1:2], k, v, jnp.asarray(cells[1:2]), Dh ** -0.5, interpret=interpret, cfg=cfg)
        assert_close_rel(o, want, 1e-5, f"attend {cfg}")
        assert_bits_equal(one[0], o[1], f"attend {cfg}: row 1 alone")
