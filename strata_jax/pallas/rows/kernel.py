"""Pallas kernels of the per-row ops: one program per row (Triton lowering on GPU; interpret mode elsewhere).

Each program loads one row, padded to a power of two ``Dp >= 16`` with a neutral value (0 for sums and norms,
-1e30 for the softmax), reduces it with one in-register reduction (`jnp.sum` / `jnp.max`: Triton's fixed
reduction tree for a [1, Dp] tile) and writes the row. The reduction order of a row's result therefore depends
only on the row's length and these constants -- never on how many rows the call holds or what they contain (the
batch-invariant rule for norms: one program per row, no split of the reduced axis).

Interpret mode runs the grid as an XLA loop whose body is the kernel; a grid of one program would be folded into
straight-line code and rounded differently from the loop body, so calls of one row run a second, idle row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from strata_jax.pallas import dispatch

NEG = -1e30
MIN_WIDTH = 16


def padded_width(n: int) -> int:
    return max(MIN_WIDTH, pl.next_power_of_2(int(n)))


def _launch(kernel, x2, fill, *, interpret, extra=(), out_width=None, name):
    """Run ``kernel(x_ref, *extra_refs, o_ref)`` with one program per row of x2 [N, n] (rows padded to Dp)."""
    N, n = x2.shape
    Dp = padded_width(n)
    rows = max(N, 2) if interpret else N
    xp = jnp.pad(x2, [(0, rows - N), (0, Dp - n)], constant_values=fill)
    ow = Dp if out_width is None else out_width
    extra_p = [jnp.pad(e.astype(jnp.float32).reshape(1, -1), [(0, 0), (0, Dp - e.size)]) for e in extra]
    call = dispatch.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct((rows, ow), jnp.float32)], grid=(rows,),
        in_specs=[pl.BlockSpec((1, Dp), lambda i: (i, 0))] + [pl.BlockSpec((1, Dp), lambda i: (0, 0))] * len(extra),
        out_specs=[pl.BlockSpec((1, ow), lambda i: (i, 0))], interpret=interpret, num_warps=4, num_stages=1,
        name=name)
    (out,) = call(xp, *extra_p)
    return out[:N]


def _norm_kernel(x_ref, *refs, eps, n, mean, has_w):
    o_ref = refs[-1]
    x = x_ref[...].astype(jnp.float32)
    ss = jnp.sum(x * x, axis=1, keepdims=True)
    if mean:
        ss = ss / n
    y = x * jax.lax.rsqrt(ss + eps)
    if has_w:
        y = y * refs[0][...]
    o_ref[...] = y


def rms_norm(x2, w, eps, *, mean, interpret):
    n = x2.shape[1]
    k = functools.partial(_norm_kernel, eps=float(eps), n=float(n), mean=mean, has_w=w is not None)
    out = _launch(k, x2.astype(jnp.float32), 0.0, interpret=interpret, extra=() if w is None else (w,),
                  name="rows_rms_norm" if mean else "rows_l2_norm")
    return out[:, :n]


def _sum_kernel(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(jnp.sum(x_ref[...].astype(jnp.float32), axis=1, keepdims=True), o_ref.shape)


def row_sum(x2, *, interpret):
    out = _launch(_sum_kernel, x2.astype(jnp.float32), 0.0, interpret=interpret, out_width=MIN_WIDTH,
                  name="rows_sum")
    return out[:, :1]


def _softmax_kernel(x_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
    o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)


def softmax(x2, *, interpret):
    n = x2.shape[1]
    return _launch(_softmax_kernel, x2.astype(jnp.float32), NEG, interpret=interpret, name="rows_softmax")[:, :n]


def _map_kernel(x_ref, o_ref, *, fn):
    o_ref[...] = fn(x_ref[...].astype(jnp.float32)).astype(jnp.float32)


def row_map(fn, x2, *, interpret):
    n = x2.shape[1]
    return _launch(functools.partial(_map_kernel, fn=fn), x2.astype(jnp.float32), 0.0, interpret=interpret,
                   name="rows_map")[:, :n]
