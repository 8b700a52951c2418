"""Reductions whose result for a row does not depend on how many rows are reduced together.

XLA vectorises a reduction over the last axis differently depending on the sizes of the other axes (seen on XLA
CPU: the RMS of a [1, 576] row differs in the last bit from the same row inside an [8, 576] array). A verify window
or a batch window must give each row exactly the arithmetic of that row alone, so every reduction on the row path
uses a fixed pairwise tree built from elementwise adds of halves: the summation order then depends only on the
length of the reduced axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pairwise_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Sum over ``axis`` in a fixed pairwise order (elementwise adds of halves, zero-padded to a power of two):
    the order depends only on the axis's length. The axis is kept with length 1."""
    axis = axis % x.ndim
    n = x.shape[axis]
    p = 1
    while p < n:
        p *= 2
    if p != n:
        pad = list(x.shape)
        pad[axis] = p - n
        x = jnp.concatenate([x, jnp.zeros(pad, x.dtype)], axis=axis)
    while x.shape[axis] > 1:
        h = x.shape[axis] // 2
        x = jax.lax.slice_in_dim(x, 0, h, axis=axis) + jax.lax.slice_in_dim(x, h, 2 * h, axis=axis)
    return x


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in a fixed pairwise order. x [..., n] -> [..., 1] (keepdims)."""
    return pairwise_sum(x, -1)


def row_mean(x: jax.Array) -> jax.Array:
    """Mean over the last axis (keepdims), in `row_sum`'s fixed order."""
    return row_sum(x) / x.shape[-1]


def row_max(x: jax.Array) -> jax.Array:
    """Max over the last axis (keepdims). Max is exact in any order; provided for symmetry."""
    return jnp.max(x, axis=-1, keepdims=True)


def row_loop(n_rows: int, fn, out_shape) -> jax.Array:
    """``stack([fn(t) for t in range(n_rows)])`` float32 [n_rows, *out_shape] in one loop whose trip count XLA
    cannot see (>= 2 rows allocated): each row runs the one compiled body, with the shapes of one row, whatever
    ``n_rows`` is (XLA:CPU vectorises elementwise ops such as ``exp`` by the size of the whole array, so batching
    rows in one op would give a row other bits at another row count). For the CPU reference paths."""
    rows = max(n_rows, 2)

    def body(t, acc):
        return jax.lax.dynamic_update_index_in_dim(acc, fn(t), t, axis=0)

    out = jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(n_rows)), body,
                            jnp.zeros((rows, *out_shape), jnp.float32))
    return out[:n_rows]


def softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis with a row-independent sum. -inf entries give 0."""
    e = jnp.exp(x - jax.lax.stop_gradient(row_max(x)))
    return e / row_sum(e)
