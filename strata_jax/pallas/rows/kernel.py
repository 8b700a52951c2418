"""Pallas kernels of the per-row ops: one program per row (Triton lowering on GPU; interpret mode elsewhere).

Each program loads one row as a [1, Dp] tile (Dp: the row length rounded up to a power of two >= 16; the lanes
past the row hold a neutral value: 0 for sums and norms, -1e30 for the softmax), reduces it with one in-register
reduction (`jnp.sum` / `jnp.max`: Triton's fixed reduction tree for a [1, Dp] tile) and stores the row's ``n``
values with a masked store. The reduction order of a row's result therefore depends only on the row's length and
these constants -- never on how many rows the call holds or what they contain (the batch-invariant rule for
norms: one program per row, no split of the reduced axis).

The operands are read in place (flat refs, the lanes past the row masked in the kernel) and the output has the
row's own width, so a call is one launch: no padded copies of the activations or the weight before it, no slice
after it (2026-12-03, H200: the pads and slices around the norms were 6 of the ~22 launches of a 1.5B layer).

Interpret mode runs the grid as an XLA loop whose body is the kernel; a grid of one program would be folded into
straight-line code and rounded differently from the loop body, so calls of one row run a second, idle row (its
loads clamped to the last row). Its masked store is a scatter that writes the masked lanes too, so there each
program stores its whole padded row and the caller slices (the arithmetic is the compiled kernel's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from strata_jax.pallas import dispatch

NEG = -1e30
MIN_WIDTH = 16


def padded_width(n: int) -> int:
    return max(MIN_WIDTH, pl.next_power_of_2(int(n)))


def _source_row(r, heads):
    """The input row of output row ``r`` under ``heads`` = (h_in, h_out, order): output row ``(g, j)`` (j < h_out)
    reads input row ``(g, j mod h_in)`` ("tiled") or ``(g, j // (h_out / h_in))`` ("grouped"); None: row r."""
    if heads is None:
        return r
    h_in, h_out, order = heads
    j = r % h_out
    return (r // h_out) * h_in + (j % h_in if order == "tiled" else j // (h_out // h_in))


def _row_base(src, n, addr):
    """The flat offset of input row ``src`` (rows of n values): ``src * n``, or under ``addr`` = (per, stride, off[,
    step]) row ``src % per`` of the ``per`` rows that start at ``off`` in record ``src // per`` of ``stride``
    values, ``step`` (default n) apart (the heads of a fused projection's output read in place; step 0: the
    record's one row shared by its ``per`` programs)."""
    if addr is None:
        return src * n
    per, stride, off = addr[:3]
    step = addr[3] if len(addr) > 3 else n
    return (src // per) * stride + off + (src % per) * step


def _lanes(cc, addr):
    """The lane offsets of a row's load: ``cc``, or 0 for every lane when ``addr``'s fifth entry is False (one
    value per row, broadcast over the tile: a per-row scale)."""
    return cc if addr is None or len(addr) < 5 or addr[4] else cc * 0


def _row_program(x_ref, *refs, kernel, N, n, Dp, ow, fill, n_extra, n_rows, n_out, extra_rows, heads, interpret,
                 addrs=None):
    """Program i: row i of the flat x_ref [N * n] as a [1, Dp] tile (lanes >= n = ``fill``), row i of each of the
    ``n_rows`` further row operands (flat [N * n], lanes >= n = 0), the extra operands (flat [k * n] each, row i
    reading its row ``i mod k``, k from ``extra_rows``; lanes >= n = 0), ``kernel(x, *rows, *extras) -> [1, Dp]``
    (or ``n_out`` of them), lanes < ``ow`` stored to row i of each output (interpret mode: all Dp lanes to row i of
    an [rows, Dp] output, sliced by the caller). ``heads``: the x and row operands' row is `_source_row` of i (N
    counts output rows; each output row the program of its input row, copied to every head that reads it)."""
    o_refs = refs[n_rows + n_extra:]
    i = pl.program_id(0)
    r = jnp.minimum(i, N - 1)            # interpret mode's idle row reads the last row (its output is sliced off)
    src = _source_row(r, heads)
    col = lax.broadcasted_iota(jnp.int32, (1, Dp), 1)
    live = col < n
    cc = jnp.minimum(col, n - 1)         # in-bounds addresses for the masked lanes
    addrs = addrs or (None,) * (1 + n_rows)
    x = jnp.where(live, x_ref[_row_base(src, n, addrs[0]) + _lanes(cc, addrs[0])].astype(jnp.float32), fill)
    more = [jnp.where(live, e[_row_base(src, n, a) + _lanes(cc, a)].astype(jnp.float32), 0.0)
            for e, a in zip(refs[:n_rows], addrs[1:])]
    extras = [jnp.where(live, e[(r % k) * n + cc if k > 1 else cc].astype(jnp.float32), 0.0)
              for e, k in zip(refs[n_rows:n_rows + n_extra], extra_rows)]
    ys = kernel(x, *more, *extras)
    for o_ref, y in zip(o_refs, ys if n_out > 1 else (ys,)):
        y = y.astype(o_ref.dtype)
        if interpret:  # the interpreter's masked store is a scatter that also writes its masked lanes: a whole row
            o_ref[i * Dp + col] = y
        else:
            plt.store(o_ref.at[r * ow + jnp.minimum(col, ow - 1)], y, mask=col < ow)


def _launch(kernel, x2, fill, *, interpret, rows_in=(), extra=(), out_width=None, n_out=1, out_dtypes=None,
            heads=None, name, packed=None):
    """``kernel(x [1, Dp], *rows_in [1, Dp], *extras [1, Dp]) -> [1, Dp]`` (or a tuple of ``n_out``) for every row
    of x2 [N, n] (``rows_in``: more [N, n] operands read row by row; ``extra``: [n] or [k, n] operands, row i
    reading row i mod k), one program per row; returns float32 (or ``out_dtypes``, one per output) [N, out_width
    or n] (the first lanes of each row's result), or a tuple of ``n_out`` of them. ``heads`` = (h_in, h_out,
    order): x2's rows are groups of h_in heads and the output's groups of h_out (`_source_row`): N / h_in * h_out
    output rows, one program each. ``packed`` = ((N, n), addrs): x2 and rows_in are flat records holding the rows
    at the offsets of `_row_base` / `_lanes` (one address tuple or None per operand, x first), N rows of n values,
    read in place (no slice or broadcast launch before the call)."""
    N, n = x2.shape if packed is None else packed[0]
    if heads is not None:
        N = N // heads[0] * heads[1]
    Dp = padded_width(n)
    rows = max(N, 2) if interpret else N
    ow = n if out_width is None else out_width
    full = pl.no_block_spec
    call = dispatch.pallas_call(
        functools.partial(_row_program, kernel=kernel, N=N, n=n, Dp=Dp, ow=ow, fill=fill, n_extra=len(extra),
                          n_rows=len(rows_in), n_out=n_out, extra_rows=tuple(e.size // n for e in extra),
                          heads=heads, interpret=interpret, addrs=None if packed is None else packed[1]),
        out_shape=[jax.ShapeDtypeStruct((rows * Dp,) if interpret else (N * ow,), dt)
                   for dt in (out_dtypes or (jnp.float32,) * n_out)],
        grid=(rows,), in_specs=[full] * (1 + len(rows_in) + len(extra)), out_specs=[full] * n_out,
        interpret=interpret, num_warps=4, num_stages=1, name=name)
    outs = call(x2.reshape(-1), *(e.reshape(-1) for e in rows_in), *(e.reshape(-1) for e in extra))
    outs = [o.reshape(rows, Dp)[:N, :ow] if interpret else o.reshape(N, ow) for o in outs]
    return tuple(outs) if n_out > 1 else outs[0]


def _norm_kernel(x, *w, eps, n, mean):
    ss = jnp.sum(x * x, axis=1, keepdims=True)
    if mean:
        ss = ss / n
    y = x * jax.lax.rsqrt(ss + eps)
    return y * w[0] if w else y


def rms_norm(x2, w, eps, *, mean, interpret):
    n = x2.shape[1]
    k = functools.partial(_norm_kernel, eps=float(eps), n=float(n), mean=mean)
    return _launch(k, x2, 0.0, interpret=interpret, extra=() if w is None else (w,),
                   name="rows_rms_norm" if mean else "rows_l2_norm")


def _qk_norm_kernel(q, k, *, eps, n, q_scale):
    return _norm_kernel(q, eps=eps, n=n, mean=False) * q_scale, _norm_kernel(k, eps=eps, n=n, mean=False)


def qk_l2_norm(q2, k2, eps, *, q_scale, heads, interpret, packed=None):
    """(l2norm(q) * q_scale, l2norm(k)) of rows q2, k2 [N, n] (groups of h_in heads), each written to the heads
    of the output that read it (``heads`` = (h_in, h_out, order), `_source_row`): [N / h_in * h_out, n] each, one
    launch (each program the norms of one q row and one k row). ``packed`` (`_launch`): q2 and k2 are one array
    of records holding both, read in place."""
    n = q2.shape[1] if packed is None else packed[0][1]
    kern = functools.partial(_qk_norm_kernel, eps=float(eps), n=float(n), q_scale=float(q_scale))
    return _launch(kern, q2, 0.0, interpret=interpret, rows_in=(k2,), n_out=2, heads=heads, name="rows_qk_l2_norm",
                   packed=packed)


def _write_norm_kernel(x, y, s, w, *, eps, n):
    h = x + y * s
    return h, _norm_kernel(h, w, eps=eps, n=n, mean=True)


def hc_write_norm(R2, y2, inj, w, eps, *, hc, interpret):
    """A hyper-connection write and the next read's per-stream norm: rows R2 [N * hc, D] (stream c of token t at
    row t * hc + c), y2 [N, D], inj [N * hc] (one weight per stream row), w [hc, D] -> (R2 + y * inj, its RMSNorm
    times w[c]), float32 [N * hc, D] each, one launch (each program one stream row: y's row and the stream's
    weight read in place, no broadcast before the call)."""
    N, D = R2.shape
    k = functools.partial(_write_norm_kernel, eps=float(eps), n=float(D))
    return _launch(k, R2, 0.0, interpret=interpret, rows_in=(y2, inj), extra=(w,), n_out=2,
                   packed=((N, D), (None, (hc, D, 0, 0), (1, 1, 0, 0, False))), name="rows_hc_write_norm")


def _add_norm_kernel(x, r, *w, eps, n):
    h = x + r
    return h, _norm_kernel(h, *w, eps=eps, n=n, mean=True)


def add_rms_norm(x2, r2, w, eps, *, interpret):
    """(x2 + r2, RMSNorm of it) for rows [N, n]: one launch for a residual add and the norm behind it."""
    k = functools.partial(_add_norm_kernel, eps=float(eps), n=float(x2.shape[1]))
    return _launch(k, x2, 0.0, interpret=interpret, rows_in=(r2,), extra=() if w is None else (w,), n_out=2,
                   name="rows_add_rms_norm")


def _sum_kernel(x, *w, fn=None):
    s = jnp.broadcast_to(jnp.sum(x * w[0] if w else x, axis=1, keepdims=True), x.shape)
    return s if fn is None else _map_kernel(s, fn=fn)


def row_sum(x2, *, interpret, fn=None, w=None):
    """The sum of each row of x2 [N, n] (float32 [N, 1]); ``w`` [n]: of ``x * w`` (the product in the program:
    Triton may contract it into the adds, a fixed choice for every row); ``fn``: an elementwise function applied to
    the sum in the same program (`row_map`'s per-lane code on the sum broadcast over the tile: its bits)."""
    return _launch(functools.partial(_sum_kernel, fn=fn), x2, 0.0, interpret=interpret, out_width=1,
                   extra=() if w is None else (w,), name="rows_sum" if fn is None and w is None else
                   "rows_sum_map" if w is None else "rows_dot_map")


def _softmax_kernel(x):
    e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
    return e / jnp.sum(e, axis=1, keepdims=True)


def softmax(x2, *, interpret):
    return _launch(_softmax_kernel, x2, NEG, interpret=interpret, name="rows_softmax")


def _softmax_top_k_kernel(x, *, n, k, renorm_min=None):
    """`_softmax_kernel`'s row, then k rounds of (max, its lowest lane, that lane removed): the values and lanes
    of the k largest in descending order, ties to the lower lane (`jax.lax.top_k`'s order for the softmax's
    values, which are never -0.0 or NaN for a row without NaN); result j in lane j."""
    p = _softmax_kernel(x)
    Dp = x.shape[1]
    col = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    v = jnp.where(col < n, p, -jnp.inf)
    vals = jnp.zeros(x.shape, jnp.float32)
    ids = jnp.zeros(x.shape, jnp.int32)
    for j in range(k):
        m = jnp.max(v, axis=1, keepdims=True)
        at = jnp.min(jnp.where(v == m, col, Dp), axis=1, keepdims=True)
        vals = jnp.where(col == j, m, vals)
        ids = jnp.where(col == j, at, ids)
        v = jnp.where(col == at, -jnp.inf, v)
    if renorm_min is not None:  # the k values over their sum (at least renorm_min): the router's renormalisation
        vals = vals / jnp.maximum(jnp.sum(jnp.where(col < k, vals, 0.0), axis=1, keepdims=True), renorm_min)
    return vals, ids


def softmax_top_k(x2, k: int, *, interpret, renorm_min=None):
    """(values float32 [N, k], ids int32 [N, k]): each row's softmax and its k largest, in one launch; with
    ``renorm_min`` the values divided by max(their sum, renorm_min)."""
    kern = functools.partial(_softmax_top_k_kernel, n=int(x2.shape[1]), k=int(k), renorm_min=renorm_min)
    return _launch(kern, x2, NEG, interpret=interpret, out_width=int(k), n_out=2,
                   out_dtypes=(jnp.float32, jnp.int32), name="rows_softmax_top_k")


def _map_kernel(x, *, fn):
    return fn(x).astype(jnp.float32)


def row_map(fn, x2, *, interpret):
    return _launch(functools.partial(_map_kernel, fn=fn), x2, 0.0, interpret=interpret, name="rows_map")


def _map_multi_kernel(*tiles, fn, n_out):
    ys = fn(*tiles)
    return tuple(y.astype(jnp.float32) for y in ys) if n_out > 1 else ys.astype(jnp.float32)


def row_map_multi(fn, xs, params, *, n_out, interpret):
    """``fn(*rows, *params)`` per row: xs a tuple of [N, n] operands read row by row, params [n] operands read by
    every row; ``n_out`` float32 [N, n] outputs (a tuple when > 1), one launch."""
    return _launch(functools.partial(_map_multi_kernel, fn=fn, n_out=n_out), xs[0], 0.0, interpret=interpret,
                   rows_in=tuple(xs[1:]), extra=tuple(params), n_out=n_out, name="rows_map_multi")

