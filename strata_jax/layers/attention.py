"""Softmax attention over a per-slot K/V cache: GQA, optional sliding window, verify-window and prefill forms.

Source: Vaswani et al. 2017; GQA (Ainslie et al. 2023): query head h reads KV head ``h // (n_head / n_head_kv)``
(HF ``repeat_kv``); sliding window as HF Gemma 3 (a query at position p sees cells p - window < c <= p).

Two paths, chosen like a Pallas op's (`strata_jax.pallas.dispatch`, op ``qsa.attend_cells``):

* the kernel path (GPU; ``STRATA_PALLAS_IMPL=interpret`` on a CPU): every row of a verify window lists the cells
  it may attend (its slot's causal, sliding-window-limited cells, as offsets into the flat caches) and one call of
  `strata_jax.pallas.qsa.attend_cells` (split-KV flash decoding with a split layout fixed by the cache length)
  attends them all: a row's arithmetic depends only on the cache length, never on B, T or the other rows. A
  prefill chunk takes `strata_jax.pallas.qsa.attend_range` instead (each row's cell range ``[lo, hi)`` on
  tensor-core tiles of fixed cells shared by the chunk's rows: a row's bits depend on its range only, not on T;
  they are not the window path's bits, and need not be: a position is read by prefill or by a window, the same
  way whatever the batch);
* the reference path (XLA on a CPU): in a verify window each (segment, row) is computed by itself (`exact.row_loop`:
  one loop body with one row's shapes, the softmax's sum in `strata_jax.layers.exact`'s fixed order), so the
  arithmetic of a row never depends on how many segments or rows its window holds or what they contain; prefill
  chunks use one large product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.layers.exact import row_loop, softmax
from strata_jax.pallas.qsa import attend_cells, attend_cells_path, attend_range, attend_range_path
from strata_jax.state import Rows, kv_view

_NEG = -1e30


def _mask(cells: jax.Array, pos: jax.Array, max_context: int, window: int) -> jax.Array:
    """bool [..., S1]: which cells a query at ``pos`` [...] may attend."""
    pos = pos[..., None]
    m = (cells <= pos) & (cells < max_context)
    if isinstance(window, int) and window == 0:
        return m
    return m & ((window <= 0) | (cells > pos - window))


def attend_window(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, rows: Rows, *, scale: float,
                  max_context: int, window: int = 0) -> jax.Array:
    """Attention of verify-window rows over their slots' caches (which already hold this window's K/V).

    Args:
      q: float32 [B, T, Hq, D] (RoPE applied).
      k_cache, v_cache: [n_slots, max_context + 1, Hkv, D], float32 or bfloat16 (or uint16: bfloat16 bit patterns,
        `strata_jax.state.kv_zeros`).
      rows: the window layout (slot and first position of each segment).
      scale: softmax scale; max_context: cells per slot; window: sliding window (0 = none; may be a traced int).

    Returns:
      float32 [B, T, Hq, D].
    """
    k_cache, v_cache = kv_view(k_cache), kv_view(v_cache)
    path = _kernel_path(q, k_cache, v_cache)
    if path != "reference":
        return _attend_cells(q, k_cache, v_cache, rows, scale, max_context, window, path)
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    g = Hq // Hkv
    K = k_cache[rows.slot].astype(jnp.float32)  # [B, S1, Hkv, D]: once per call (exact: a row's bits do not move)
    V = v_cache[rows.slot].astype(jnp.float32)
    cells = jnp.arange(K.shape[1], dtype=jnp.int32)
    pos = rows.positions(T).reshape(B * T)
    qf = q.reshape(B * T, Hkv, g, D)

    # one (segment, row) per iteration of a loop XLA cannot see through: a row's ops have the shapes of one row
    # whatever B and T are (XLA:CPU vectorises exp and the reductions by the whole array's size)
    def one_row(i):
        Kb = jax.lax.dynamic_index_in_dim(K, i // T, keepdims=False)                          # [S1, Hkv, D]
        Vb = jax.lax.dynamic_index_in_dim(V, i // T, keepdims=False)
        qt = jax.lax.dynamic_index_in_dim(qf, i, keepdims=False)                              # [Hkv, g, D]
        s = jnp.einsum("kgd,skd->kgs", qt, Kb) * scale
        m = _mask(cells, jax.lax.dynamic_index_in_dim(pos, i, keepdims=False), max_context, window)  # [S1]
        s = jnp.where(m[None, None, :], s, _NEG)
        o = jnp.einsum("kgs,skd->kgd", softmax(s), Vb)
        return o.reshape(Hq, D)

    return row_loop(B * T, one_row, (Hq, D)).reshape(B, T, Hq, D)


def attend_prefill(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, rows: Rows, *, scale: float,
                   max_context: int, window: int = 0) -> jax.Array:
    """Causal attention of a prefill chunk (one segment per slot) over the slots' caches.

    Args/Returns: as `attend_window`, with T the chunk length.
    """
    k_cache, v_cache = kv_view(k_cache), kv_view(v_cache)
    path = attend_range_path(q, _flat(k_cache), _flat(v_cache))
    if path != "reference":  # tensor-core tiles shared by the chunk's rows, each row over its causal range
        pos = rows.positions(q.shape[1])                                           # [B, T]
        hi = jnp.minimum(pos + 1, max_context)
        lo = jnp.zeros_like(pos) if isinstance(window, int) and window == 0 else \
            jnp.where(window > 0, jnp.maximum(pos - window + 1, 0), 0)
        per_slot = k_cache.shape[1]
        return attend_range(q, _flat(k_cache), _flat(v_cache), lo, hi, rows.slot * per_slot, n_cells=per_slot,
                            scale=scale, impl=path)
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    g = Hq // Hkv
    K = k_cache[rows.slot].astype(jnp.float32)
    V = v_cache[rows.slot].astype(jnp.float32)
    cells = jnp.arange(K.shape[1], dtype=jnp.int32)
    pos = rows.positions(T)
    qg = q.reshape(B, T, Hkv, g, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, K) * scale
    m = _mask(cells, pos, max_context, window)  # [B, T, S1]
    s = jnp.where(m[:, None, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p, V)
    return o.reshape(B, T, Hq, D)


def _flat(cache):
    """[n_slots, S1, Hkv, D] -> [n_slots * S1, Hkv, D] (a free reshape)."""
    return cache.reshape(-1, *cache.shape[2:])


def _kernel_path(q, k_cache, v_cache) -> str:
    B, T, Hq, D = q.shape
    return attend_cells_path(q.reshape(B * T, Hq, D), _flat(k_cache), _flat(v_cache))


def _attend_cells(q, k_cache, v_cache, rows: Rows, scale, max_context, window, path):
    """The kernel path (module docstring): each row's visible cells of its slot, listed, attended in one call."""
    B, T, Hq, D = q.shape
    per_slot = k_cache.shape[1]
    cells = jnp.arange(per_slot, dtype=jnp.int32)
    m = _mask(cells, rows.positions(T), max_context, window)                      # [B, T, S1]
    ids = jnp.where(m, rows.slot[:, None, None] * per_slot + cells, -1)
    o = attend_cells(q.reshape(B * T, Hq, D), _flat(k_cache), _flat(v_cache), ids.reshape(B * T, per_slot),
                     scale=scale, impl=path)
    return o.reshape(B, T, Hq, D)
