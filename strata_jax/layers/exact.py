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


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in a fixed pairwise order. x [..., n] -> [..., 1] (keepdims)."""
    n = x.shape[-1]
    p = 1
    while p < n:
        p *= 2
    if p != n:
        x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (p - n,), x.dtype)], axis=-1)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x


def row_mean(x: jax.Array) -> jax.Array:
    """Mean over the last axis (keepdims), in `row_sum`'s fixed order."""
    return row_sum(x) / x.shape[-1]


def row_max(x: jax.Array) -> jax.Array:
    """Max over the last axis (keepdims). Max is exact in any order; provided for symmetry."""
    return jnp.max(x, axis=-1, keepdims=True)


def softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis with a row-independent sum. -inf entries give 0."""
    e = jnp.exp(x - jax.lax.stop_gradient(row_max(x)))
    return e / row_sum(e)
