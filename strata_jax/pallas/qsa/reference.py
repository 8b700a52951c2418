"""Plain-jnp reference of QSA sparse attention: indexer block scores, block selection, attention over the
selected cells (Strata ``include/strata/kernels/qsa.hpp``; mlx-vlm ``Qwen4ExpQSAIndexer``).

Row independence: every query row goes through the same compiled loop body (a loop over the rows whose trip count
XLA cannot see, over at least two rows), so a row's scores, selection and output do not depend on T or on the
other rows. The selection itself is exact (integer top-k on scores computed row by row).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from strata_jax.layers.exact import row_loop

HP = lax.Precision.HIGHEST
NEG = -1e30  # "minus infinity" that keeps exp() and max() finite


def block_scores(iq, pooled, seg=None):
    """Indexer scores: [T, NB] float32, ``score[t, b] = sum_h ReLU(iq[t, h] . pooled[b])`` (h summed in order).

    iq [T, Hi, Di] (RMS-normed and RoPE'd indexer queries), pooled [NB, Di] (pooled block keys), or [S, NB, Di]
    with seg int32 [T] (row t scores the blocks pooled[seg[t]]: rows of several sequences); any float dtype.
    """
    iq = iq.astype(jnp.float32)
    pooled = pooled.astype(jnp.float32)

    def row(t):
        qt = lax.dynamic_index_in_dim(iq, t, axis=0, keepdims=False)            # [Hi, Di]
        pk = pooled if seg is None else lax.dynamic_index_in_dim(pooled, seg[t], axis=0, keepdims=False)
        s = jnp.maximum(lax.dot_general(qt, pk, (((1,), (1,)), ((), ())), precision=HP), 0.0)  # [Hi, NB]
        acc = s[0]
        for h in range(1, s.shape[0]):
            acc = acc + s[h]
        return acc

    return row_loop(iq.shape[0], row, (pooled.shape[-2],))


def select_blocks(scores, n_complete, top_blocks: int):
    """The top ``top_blocks`` complete blocks of each row: int32 [T, top_blocks], ascending, -1 padded.

    Blocks b >= n_complete[t] are never chosen; ties go to the lower block index (`lax.top_k` is stable). With
    n_complete[t] <= top_blocks every complete block is chosen.
    """
    T, NB = scores.shape
    valid = jnp.arange(NB, dtype=jnp.int32)[None, :] < n_complete[:, None]
    s = jnp.where(valid, scores, -1.0)  # scores >= 0, so every complete block outranks every other
    if NB < top_blocks:
        s = jnp.pad(s, [(0, 0), (0, top_blocks - NB)], constant_values=-1.0)
    vals, idx = lax.top_k(s, top_blocks)
    big = jnp.int32(2**30)
    idx = jnp.sort(jnp.where(vals >= 0, idx.astype(jnp.int32), big), axis=1)
    return jnp.where(idx == big, -1, idx)


def selected_cells(blocks, n_kv, n_complete, block: int):
    """Cell ids each row attends: int32 [T, top_blocks * block + block - 1], ascending, -1 padded.

    The cells of the chosen blocks, then the unfinished tail ``n_complete * block <= c < n_kv`` (at most
    block - 1 cells).
    """
    T, nb = blocks.shape
    lane = jnp.arange(block, dtype=jnp.int32)
    bc = jnp.where(blocks[:, :, None] >= 0, blocks[:, :, None] * block + lane, -1).reshape(T, nb * block)
    tail = n_complete[:, None] * block + lane[None, : block - 1]
    tail = jnp.where(tail < n_kv[:, None], tail, -1)
    return jnp.concatenate([bc, tail], axis=1)


def attend(q, k_cache, v_cache, cells, scale):
    """Softmax attention of each row over its cells (GQA: q head h uses kv head h // (Hq // Hkv)).

    q [T, Hq, D]; k_cache, v_cache [N, Hkv, D]; cells int32 [T, C] (-1 = none). Returns float32 [T, Hq, D].
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    qf = q.astype(jnp.float32)

    def row(t):
        c = lax.dynamic_index_in_dim(cells, t, axis=0, keepdims=False)         # [C]
        ok = c >= 0
        cc = jnp.maximum(c, 0)
        kk = k_cache[cc].astype(jnp.float32)                                    # [C, Hkv, D]
        vv = v_cache[cc].astype(jnp.float32)
        qt = lax.dynamic_index_in_dim(qf, t, axis=0, keepdims=False).reshape(Hkv, G, D)
        s = jnp.einsum("kgd,ckd->kgc", qt, kk, precision=HP) * scale
        s = jnp.where(ok[None, None, :], s, NEG)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.where(ok[None, None, :], jnp.exp(s - m), 0.0)
        o = jnp.einsum("kgc,ckd->kgd", p, vv, precision=HP) / jnp.sum(p, axis=-1, keepdims=True)
        return o.reshape(Hq, D)

    return row_loop(T, row, (Hq, D))


def select(iq, pooled, n_kv, n_complete, *, top_blocks: int, block: int, seg=None, cell_base=None):
    """Scores + selection + cell list (shared by the reference and the kernel path): int32 [T, C], -1 padded.

    seg: see `block_scores`; cell_base int32 [T] (or None = 0) is added to every selected cell id of row t (rows of
    several sequences attending their own part of one flat cache)."""
    return cells_from_scores(block_scores(iq, pooled, seg), n_kv, n_complete, top_blocks=top_blocks, block=block,
                             cell_base=cell_base)


def cells_from_scores(scores, n_kv, n_complete, *, top_blocks: int, block: int, cell_base=None):
    """The cell list of `select` from block scores [T, NB] (`select_blocks` + `selected_cells` + ``cell_base``)."""
    n_kv = n_kv.astype(jnp.int32)
    n_complete = n_complete.astype(jnp.int32)
    blocks = select_blocks(scores, n_complete, top_blocks)
    cells = selected_cells(blocks, n_kv, n_complete, block)
    if cell_base is not None:
        cells = jnp.where(cells >= 0, cells + cell_base.astype(jnp.int32)[:, None], -1)
    return cells


def qsa_attention(q, k_cache, v_cache, iq, pooled, n_kv, n_complete, *, top_blocks: int, block: int, scale,
                  seg=None, cell_base=None):
    cells = select(iq, pooled, n_kv, n_complete, top_blocks=top_blocks, block=block, seg=seg, cell_base=cell_base)
    return attend(q, k_cache, v_cache, cells, scale)
