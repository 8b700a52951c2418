"""Softmax attention over a per-slot K/V cache: GQA, optional sliding window, verify-window and prefill forms.

Source: Vaswani et al. 2017; GQA (Ainslie et al. 2023): query head h reads KV head ``h // (n_head / n_head_kv)``
(HF ``repeat_kv``); sliding window as HF Gemma 3 (a query at position p sees cells p - window < c <= p).

Exactness: in a verify window each row is computed by itself (``lax.map`` over the window's row axis), so the
arithmetic of a row never depends on how many rows its window holds or what they contain. Prefill chunks use one
large product instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.layers.exact import softmax
from strata_jax.state import Rows, cells_f32

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
      k_cache, v_cache: [n_slots, max_context + 1, Hkv, D], float32, bfloat16 or uint16 (bfloat16 bit patterns,
        `strata_jax.state.kv_zeros`).
      rows: the window layout (slot and first position of each segment).
      scale: softmax scale; max_context: cells per slot; window: sliding window (0 = none; may be a traced int).

    Returns:
      float32 [B, T, Hq, D].
    """
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    g = Hq // Hkv
    K = cells_f32(k_cache[rows.slot])  # [B, S1, Hkv, D]
    V = cells_f32(v_cache[rows.slot])
    cells = jnp.arange(K.shape[1], dtype=jnp.int32)
    pos = rows.positions(T)

    def one_row(t):
        qt = q[:, t].reshape(B, Hkv, g, D)
        s = jnp.einsum("bkgd,bskd->bkgs", qt, K) * scale
        m = _mask(cells, pos[:, t], max_context, window)  # [B, S1]
        s = jnp.where(m[:, None, None, :], s, _NEG)
        p = softmax(s)
        o = jnp.einsum("bkgs,bskd->bkgd", p, V)
        return o.reshape(B, Hq, D)

    out = jax.lax.map(one_row, jnp.arange(T))  # [T, B, Hq, D]
    return jnp.transpose(out, (1, 0, 2, 3))


def attend_prefill(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, rows: Rows, *, scale: float,
                   max_context: int, window: int = 0) -> jax.Array:
    """Causal attention of a prefill chunk (one segment per slot) over the slots' caches.

    Args/Returns: as `attend_window`, with T the chunk length.
    """
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    g = Hq // Hkv
    K = cells_f32(k_cache[rows.slot])
    V = cells_f32(v_cache[rows.slot])
    cells = jnp.arange(K.shape[1], dtype=jnp.int32)
    pos = rows.positions(T)
    qg = q.reshape(B, T, Hkv, g, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, K) * scale
    m = _mask(cells, pos, max_context, window)  # [B, T, S1]
    s = jnp.where(m[:, None, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p, V)
    return o.reshape(B, T, Hq, D)
