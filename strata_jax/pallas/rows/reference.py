"""Plain-jnp reference of the per-row ops (the CPU path): fixed pairwise reduction trees and a loop over rows.

XLA on a CPU vectorises a reduction over the last axis, and evaluates exp/log-based elementwise functions with
vector instructions on the fused iteration space and scalar ones on its remainder, differently for different sizes
of the other axes (seen: the RMS of a [1, 576] row differs in the last bit from the same row inside an [8, 576]
array; sigmoid of 4 values differs with the number of rows). So the reference reduces in the fixed pairwise order
of `strata_jax.layers.exact` (elementwise adds of halves: the order depends only on the row's length) and runs
`row_map` one row at a time (``lax.map``), which makes every row's arithmetic independent of the row count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.layers import exact


def rms_norm(x, w, eps: float, mean: bool = True):
    x = x.astype(jnp.float32)
    ss = exact.row_mean(x * x) if mean else exact.row_sum(x * x)
    y = x * jax.lax.rsqrt(ss + eps)
    return y if w is None else y * w


def to_heads(a, heads: int, order: str):
    """a [..., h, n] -> [..., heads, n]: head j is head ``j % h`` ("tiled") or ``j // (heads / h)`` ("grouped")."""
    r = heads // a.shape[-2]
    if order == "tiled":
        return jnp.tile(a, (1,) * (a.ndim - 2) + (r, 1))
    return jnp.repeat(a, r, axis=-2)


def row_sum(x):
    return exact.row_sum(x.astype(jnp.float32))


def softmax(x):
    # one row at a time: XLA:CPU's fused exp(x - max) over [N, n] differs in the last bit between N < 8 and N >= 8
    return row_map(exact.softmax, x.astype(jnp.float32))


def row_map(fn, x):
    lead, n = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, n)
    return jax.lax.map(lambda r: fn(flat[r]), jnp.arange(flat.shape[0])).reshape(*lead, n)


def row_map_multi(fn, xs, params, n_out):
    lead, n = xs[0].shape[:-1], xs[0].shape[-1]
    flat = [x.reshape(-1, n).astype(jnp.float32) for x in xs]
    ps = [p.astype(jnp.float32) for p in params]

    def one(r):
        ys = fn(*(f[r] for f in flat), *ps)
        return ys if n_out > 1 else (ys,)

    outs = jax.lax.map(one, jnp.arange(flat[0].shape[0]))
    outs = tuple(o.reshape(*lead, n) for o in outs)
    return outs if n_out > 1 else outs[0]

