"""Pallas kernels for QSA over prefill chunks: each segment's query rows against its pooled blocks and its K/V
cells on tensor-core tiles (Triton lowering on GPU; interpret mode elsewhere). The maths is `reference`'s.

1. `scores_kernel`, one program per (segment b, tile of `TQS` rows, tile of `NBT` blocks): for each indexer head h
   in order, ``s_h = iq[rows, h] . pooled[blocks]^T`` ([TQS, Di] x [Di, NBT]), and the score is
   ``ReLU(s_0) + ReLU(s_1) + ...`` (heads summed in order).
2. Selection in jnp, exact integer / compare work: `reference.select_blocks` (the top ``top_blocks`` complete
   blocks, ties to the lower index), then `tile_words` packs each row's chosen blocks into one int32 word per key
   tile (bit i = block i of the tile), and `live_tiles` marks, per query tile, the key tiles that any of its rows
   attends (a chosen block or its unfinished tail).
3. The attention kernel (`_attend_kernel`, launched by `qsa_prefill_kernel`), one program per (segment b, kv
   head g, tile of TQ query rows): the M = TQ * Gp (row, query head) pairs of the tile (the group's G heads padded
   to Gp, a power of two) run a flash-attention loop over the key tiles of TK cells in ascending order (a
   compile-time trip count), skipping the tiles no row of the tile attends: ``s = q K^T * scale`` ([M, D] x
   [D, TK]), each pair masked to its row's chosen blocks and tail ``n_complete*block <= c < n_kv``, online
   softmax, ``acc += p V`` ([M, TK] x [TK, D]). A tile in which a row attends nothing leaves that row's (m, l,
   acc) untouched (a select, not arithmetic). M and TK (`tiling`) keep every float32 operand tile within
   `TILE_F32` elements.

Row independence: the key tiles sit at fixed absolute cells ``j*TK .. j*TK+TK-1`` (aligned at cell 0), the tile
shapes are compile-time constants, and the products' reduction orders depend on them only (D, Di, TK, NBT, not on
T or the rows). A row's scores depend on its own indexer query; its selection is exact; its attention state only
changes in the tiles it attends, in ascending order, whatever other rows make live. So a row's bits depend only on
its own inputs, never on T, B or the other rows (prefill rows match prefill calls; the verify-window path
`kernel` computes the same maths in another order).

Arithmetic is float32; the tile products use `dispatch.f32_dot_precision` (TF32x3 compiled, float32 in interpret
mode). Padded rows (T rounded up to the tiles) attend nothing and are dropped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from strata_jax.pallas import dispatch
from strata_jax.pallas.qsa import kernel as _k
from strata_jax.pallas.qsa import reference as _ref
from strata_jax.pallas.qsa.reference import NEG

F32 = jnp.float32
M_TILE = 64    # at most this many (row, query head) pairs per attention program
TK = 64        # at most this many cells per key tile (and at most 32 blocks: one int32 word of block bits)
TILE_F32 = 8192  # float32 elements per q / K / V operand tile at most (32 KB, the GDN chunked kernel's largest)
TQS = 32       # rows per scores program
NBT = 64       # blocks per scores program


def why_not(Hq: int, Hkv: int, D: int, n_cells: int, block: int, dtypes) -> str | None:
    r = _k.why_not(Hq, Hkv, D, n_cells, dtypes)
    if r is not None:
        return r
    if not dispatch.is_pow2(block) or block > 16:
        return f"block {block} is not a power of two <= 16"
    return None


def tiling(Hq: int, Hkv: int, D: int, block: int, m_tile: int | None = None, tk: int | None = None):
    """(Gp, TQ, TK): the group padded to a power of two, query rows and key cells per attention program
    (compile-time constants: D = 256 gives 2 rows of 16 heads x 32 cells, D = 128 4 x 16 x 64). m_tile / tk
    override the pairs per program / cells per tile (launch variants)."""
    Gp = pl.next_power_of_2(Hq // Hkv)
    m_tile = m_tile or min(M_TILE, max(16, TILE_F32 // D))
    tk = tk or min(TK, max(16, TILE_F32 // D))
    return Gp, max(1, m_tile // Gp), min(tk, 32 * block)


def _scores_kernel(q_ref, p_ref, o_ref, *, Hi, NB, Di, interpret):
    b = pl.program_id(0)
    rows = pl.ds(pl.program_id(1) * TQS, TQS)
    j = pl.program_id(2)
    prec = dispatch.f32_dot_precision(interpret)
    blk = j * NBT + lax.broadcasted_iota(jnp.int32, (NBT, 1), 0)
    off = (b * NB + jnp.minimum(blk, NB - 1)) * Di + lax.broadcasted_iota(jnp.int32, (1, Di), 1)
    pk = p_ref[off].astype(F32)                                                 # [NBT, Di]
    acc = None
    for h in range(Hi):  # heads in order, as `reference.block_scores`
        s = lax.dot_general(q_ref[b, rows, h, :].astype(F32), pk, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=F32)                         # [TQS, NBT]
        s = jnp.maximum(s, 0.0)
        acc = s if acc is None else acc + s
    o_ref[b, rows, pl.ds(j * NBT, NBT)] = acc


def scores_kernel(iq, pooled, *, interpret: bool):
    """Block scores of prefill rows: float32 [B, Tp, NBp] (the caller slices [:, :T, :NB]).

    iq [B, Tp, Hi, Di] (Tp a multiple of `TQS`; Di a power of two >= 16, `kernel.scores_why_not`), pooled
    [B, NB, Di]; any float dtypes. ``score[b, t, n] = sum_h ReLU(iq[b, t, h] . pooled[b, n])``. Not jitted."""
    B, Tp, Hi, Di = iq.shape
    NB = pooled.shape[1]
    n_bt = -(-NB // NBT)
    call = dispatch.pallas_call(
        functools.partial(_scores_kernel, Hi=Hi, NB=NB, Di=Di, interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct((B, Tp, n_bt * NBT), F32)], grid=(B, Tp // TQS, n_bt),
        in_specs=[pl.no_block_spec] * 2, out_specs=[pl.no_block_spec], interpret=interpret, num_warps=4,
        num_stages=1, name="qsa_scores_prefill")
    (sc,) = call(iq, pooled.reshape(-1))
    return sc


def tile_words(blocks, n_tiles: int, tk: int, block: int):
    """int32 [R, n_tiles]: bit i of word j is set when block ``j * (tk // block) + i`` is in the row's list.

    blocks int32 [R, k]: block ids (-1 = none, ids distinct), as `reference.select_blocks` returns them."""
    bpt = tk // block
    R = blocks.shape[0]
    j = jnp.where(blocks >= 0, blocks // bpt, n_tiles)                           # -1 -> the dropped column
    bit = jnp.left_shift(jnp.int32(1), (blocks % bpt).astype(jnp.int32))         # distinct bits: add == or
    words = jnp.zeros((R, n_tiles + 1), jnp.int32).at[jnp.arange(R)[:, None], j].add(bit)
    return words[:, :n_tiles]


def live_tiles(words, n_kv, n_complete, *, rows_per_tile: int, tk: int, block: int):
    """int32 [Q, n_tiles]: 1 where a row of query tile q attends a cell of key tile j (a chosen block or its
    unfinished tail), else 0. words [R, n_tiles] (`tile_words`), n_kv / n_complete int32 [R], R = Q * rows_per_tile."""
    R, n_tiles = words.shape
    lo = n_complete * block
    tail = jnp.where(n_kv > lo, lo // tk, n_tiles)                               # the tail lies in one block
    live = (words != 0) | (jnp.arange(n_tiles, dtype=jnp.int32)[None, :] == tail[:, None])
    return jnp.any(live.reshape(R // rows_per_tile, rows_per_tile, n_tiles), axis=1).astype(jnp.int32)


def _attend_kernel(nkv_ref, nc_ref, base_ref, live_ref, words_ref, q_ref, k_ref, v_ref, o_ref, *, Hkv, D, Gp, TQ,
                   TK, Tp, NT, NQT, n_flat, block, scale, interpret, use_words):
    b = pl.program_id(0)
    g = pl.program_id(1)
    i = pl.program_id(2)
    prec = dispatch.f32_dot_precision(interpret)
    M = TQ * Gp
    row = b * Tp + i * TQ + lax.div(lax.broadcasted_iota(jnp.int32, (M,), 0), Gp)  # [M] the pair's row
    nkv = nkv_ref[row]
    lo = nc_ref[row] * block                                                     # the tail: lo <= c < nkv
    base = base_ref[b]
    qv = q_ref[b, g, pl.ds(i * M, M), :].astype(F32)                             # [M, D]
    lane = lax.broadcasted_iota(jnp.int32, (TK,), 0)
    shift = lax.div(lane, block)[None, :]                                        # the cell's block in the tile
    dcol = lax.broadcasted_iota(jnp.int32, (1, D), 1)
    qt = b * NQT + i

    def tile(j, carry):
        m, l, acc = carry
        cell = (j * TK + lane)[None, :]                                          # [1, TK]
        ok = (cell >= lo[:, None]) & (cell < nkv[:, None])                       # [M, TK] the tail / range
        if use_words:  # QSA: the chosen blocks too (at most 32 per tile: shifts < 32, defined on the GPU)
            w = words_ref[row * NT + j][:, None]                                 # [M, 1]
            ok = ok | (((w >> shift) & 1) != 0)
        off = (jnp.minimum(base + j * TK + lane, n_flat - 1)[:, None] * Hkv + g) * D + dcol  # [TK, D]
        kk = k_ref[off].astype(F32)
        s = lax.dot_general(qv, kk, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=F32) * scale
        s = jnp.where(ok, s, NEG)
        smax = jnp.max(s, axis=1)
        live = smax > 0.5 * NEG                                                  # the row attends a cell here
        m_new = jnp.where(live, jnp.maximum(m, smax), m)
        alpha = jnp.exp(m - m_new)
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        vv = v_ref[off].astype(F32)
        pv = lax.dot_general(p, vv, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=F32)
        l = jnp.where(live, l * alpha + jnp.sum(p, axis=1), l)
        acc = jnp.where(live[:, None], acc * alpha[:, None] + pv, acc)
        return m_new, l, acc

    def body(j, carry):  # every key tile in order (a compile-time trip count); the dead ones are skipped
        return lax.cond(live_ref[qt * NT + j] != 0, functools.partial(tile, j), lambda c: c, carry)

    init = (jnp.full((M,), NEG, F32), jnp.zeros((M,), F32), jnp.zeros((M, D), F32))
    m, l, acc = lax.fori_loop(0, NT, body, init)
    o_ref[b, g, pl.ds(i * M, M), :] = acc / jnp.where(l > 0, l, 1.0)[:, None]   # padded rows: l = 0


def qsa_prefill_kernel(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, cell_base, *, top_blocks: int, block: int,
                       scale: float, interpret: bool, m_tile: int | None = None, tk: int | None = None,
                       num_warps: int = 4):
    """Same contract as `api.qsa_prefill` (cell_base int32 [B]). Not jitted.

    m_tile / tk / num_warps: launch variants (for benchmarks); a row's bits depend on them."""
    B, T, Hq, D = q.shape
    Hi, Di = iq.shape[2:]
    NB = pooled.shape[1]
    Gp, TQ, TK_ = tiling(Hq, k_cache.shape[1], D, block, m_tile, tk)
    Tp = _padded_rows(T, max(TQ, TQS), interpret)
    padt = lambda a: jnp.pad(a, [(0, 0), (0, Tp - T)] + [(0, 0)] * (a.ndim - 2))
    nkv = padt(n_kv.astype(jnp.int32)).reshape(-1)                               # padded rows: no cells
    nc = padt(n_complete.astype(jnp.int32)).reshape(-1)
    if _k.scores_why_not(Hi, Di, NB) is None:
        scores = scores_kernel(padt(iq), pooled, interpret=interpret)[:, :, :NB]
    else:  # (an indexer head dim the scores kernel cannot serve: the reference's row loop)
        seg = jnp.repeat(jnp.arange(B, dtype=jnp.int32), Tp)
        scores = _ref.block_scores(padt(iq).reshape(B * Tp, Hi, Di), pooled, seg)
    blocks = _ref.select_blocks(scores.reshape(B * Tp, NB), nc, top_blocks)
    NT = -(-(NB + 1) * block // TK_)                                              # every cell < (NB + 1) * block
    words = tile_words(blocks, NT, TK_, block)
    live = live_tiles(words, nkv, nc, rows_per_tile=TQ, tk=TK_, block=block)
    return _attend_call(q, k_cache, v_cache, nkv, nc, cell_base, live, words, Gp=Gp, TQ=TQ, TK=TK_, Tp=Tp, NT=NT,
                        block=block, scale=scale, interpret=interpret, num_warps=num_warps, name="qsa_attend_prefill",
                        use_words=True)


def _padded_rows(T: int, R: int, interpret: bool) -> int:
    """T rounded up to a multiple of R (the rows of a program's tile)."""
    Tp = -(-T // R) * R
    if interpret and Tp == R:
        Tp = 2 * R  # interpret mode folds a grid of one program into code that rounds differently (see gemv)
    return Tp


def _attend_call(q, k_cache, v_cache, nkv, nc, cell_base, live, words, *, Gp, TQ, TK, Tp, NT, block, scale, interpret,
                 num_warps, name, use_words):
    """Launch `_attend_kernel` over q [B, T, Hq, D] (rows padded to Tp, the group's heads to Gp) and return float32
    [B, T, Hq, D]: nkv / nc int32 [B * Tp] (each row's tail ``nc * block <= c < nkv``), live int32 [B * Tp // TQ,
    NT] and words int32 [B * Tp, NT] (`live_tiles`, `tile_words`; read only with ``use_words``)."""
    B, T, Hq, D = q.shape
    n_flat, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    NQT = Tp // TQ
    qg = jnp.pad(q.reshape(B, T, Hkv, G, D), [(0, 0), (0, Tp - T), (0, 0), (0, Gp - G), (0, 0)])
    qg = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(B, Hkv, Tp * Gp, D)          # pair (t, h) at t * Gp + h
    full = pl.no_block_spec
    call = dispatch.pallas_call(
        functools.partial(_attend_kernel, Hkv=Hkv, D=D, Gp=Gp, TQ=TQ, TK=TK, Tp=Tp, NT=NT, NQT=NQT, n_flat=n_flat,
                          block=block, scale=float(scale), interpret=interpret, use_words=use_words),
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, Tp * Gp, D), F32)], grid=(B, Hkv, NQT), in_specs=[full] * 8,
        out_specs=[full], interpret=interpret, num_warps=num_warps, num_stages=1, name=name)
    (o,) = call(nkv, nc, cell_base.astype(jnp.int32), live.reshape(-1), words.reshape(-1), qg,
                k_cache.reshape(-1), v_cache.reshape(-1))
    o = o.reshape(B, Hkv, Tp, Gp, D)[:, :, :T, :G]
    return jnp.transpose(o, (0, 2, 1, 3, 4)).reshape(B, T, Hq, D)


def attend_range_kernel(q, k_cache, v_cache, lo, hi, cell_base, *, n_cells: int, scale: float, interpret: bool):
    """Dense (causal, optionally sliding-window) attention of B prefill segments on the tiles of `_attend_kernel`:
    row (b, t) attends the cells ``lo[b, t] <= c < hi[b, t]`` of its segment (cache cell ``cell_base[b] + c``).

    q float32 [B, T, Hq, D]; k_cache, v_cache [N, Hkv, D] (the slots' caches, flat); lo, hi int32 [B, T]
    (0 <= lo < hi <= n_cells: at least one cell); cell_base int32 [B]; n_cells: cells per segment (a slot's cache
    length). Returns float32 [B, T, Hq, D]. Not jitted.

    The same kernel as QSA's prefill with no chosen blocks and the whole range as the "tail": key tiles at fixed
    cells from 0, the tiles outside every row's range of a query tile skipped, so a row's bits depend only on its
    own (lo, hi), D and the tiling, never on T or the other rows. (They are not the bits of `kernel.attend_kernel`,
    the verify-window path: another summation order.)"""
    B, T, Hq, D = q.shape
    Gp, TQ, TK_ = tiling(Hq, k_cache.shape[1], D, block=TK)
    Tp = _padded_rows(T, TQ, interpret)
    padt = lambda a: jnp.pad(a.astype(jnp.int32), [(0, 0), (0, Tp - T)])         # padded rows: no cells
    lo_f, hi_f = padt(lo).reshape(-1), padt(hi).reshape(-1)
    NT = -(-int(n_cells) // TK_)
    tiles = jnp.arange(NT, dtype=jnp.int32)[None, None, :] * TK_
    rlo, rhi = lo_f.reshape(-1, TQ, 1), hi_f.reshape(-1, TQ, 1)
    live = jnp.any((tiles < rhi) & (tiles + TK_ > rlo) & (rhi > rlo), axis=1).astype(jnp.int32)  # [B*Tp/TQ, NT]
    words = jnp.zeros((1,), jnp.int32)
    # block = 1: the kernel's tail range is [nc * block, nkv) = [lo, hi); no block words (a tile of 64 one-cell
    # blocks has no 32-bit word: shifting by 32..63 is undefined on the GPU, and gave garbage masks on the H200)
    return _attend_call(q, k_cache, v_cache, hi_f, lo_f, cell_base, live, words, Gp=Gp, TQ=TQ, TK=TK_, Tp=Tp, NT=NT,
                        block=1, scale=scale, interpret=interpret, num_warps=4, name="attend_range_prefill",
                        use_words=False)
