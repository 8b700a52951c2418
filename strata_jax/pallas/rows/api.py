"""Public API of the per-row ops: `rms_norm` (and `add_rms_norm`, `qk_l2_norm`), `row_sum`, `softmax` (and
`softmax_top_k`), `row_map`.

Sources: RMSNorm (Zhang & Sennrich 2019; HF ``LlamaRMSNorm``: ``x * rsqrt(mean(x^2) + eps) * w``), HF ``l2norm``
(``x * rsqrt(sum(x^2) + eps)``), softmax over the last axis.

All act on the last axis of ``x`` [..., n] (any float dtype, computed in float32) independently per row:

* ``rms_norm(x, w, eps, *, mean=True)`` -> float32 [..., n]: ``x * rsqrt(mean(x^2) + eps) * w`` (``w`` float32
  [n] or None); ``mean=False`` divides by nothing (the L2 normalisation ``x * rsqrt(sum(x^2) + eps)``).
* ``add_rms_norm(x, r, w, eps)`` -> (``x + r``, its ``rms_norm``): a residual add and the norm behind it;
  ``hc_write_norm(R, y, inj, w, eps)``: the same for a hyper-connection write (``R + y * inj`` per stream).
* ``qk_l2_norm(q, k, eps, q_scale=, heads=, order=)`` -> the GDN's L2-normalised q (scaled) and k, repeated to
  the v heads, in one launch; ``qk_l2_norm_packed(c, ...)``: the same of q and k read in place from one array.
* ``row_sum(x, fn=None, w=None)`` -> float32 [..., 1] (``w``: of x * w; ``fn``: `row_map`'s ``fn`` of the sum;
  one launch).
* ``softmax(x)`` -> float32 [..., n] (-inf entries give 0).
* ``softmax_top_k(x, k, renorm_min=None)`` -> (float32 [..., k], int32 [..., k]): ``jax.lax.top_k(softmax(x), k)`` (a
  router; ``renorm_min``: the values over max(their sum, renorm_min)).
* ``row_map(fn, x)`` -> float32 [..., n]: an elementwise ``fn`` (sigmoid, softplus, ...) applied per row (for
  narrow rows, whose arithmetic XLA on a CPU would otherwise choose by the number of rows); ``row_map_multi(fn,
  xs, params, n_out=)``: the same over several operands and per-lane parameters, several outputs, one launch.

Row invariance (both paths): a row's result is bit-identical whatever the other rows hold and however many there
are. The reference (the CPU path) gets it from fixed pairwise trees and a loop over rows (`reference`); the kernel
(one Pallas program per row, `kernel`) from its fixed in-register reduction. The two agree to ~1e-6 relative, not
bitwise.

``impl``: "auto" | "reference" | "kernel" | "interpret" (`strata_jax.pallas.dispatch`).

Errors: `strata_jax.errors.UnsupportedError` for an unknown impl, or impl="kernel"/"interpret" where the kernel
cannot serve (a non-float dtype, a row wider than `MAX_WIDTH`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from strata_jax.errors import UnsupportedError
from strata_jax.pallas import dispatch
from strata_jax.pallas.rows import kernel as _k
from strata_jax.pallas.rows import reference as _ref

MAX_WIDTH = 2 ** 16


def _why_not(x):
    def f():
        if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"dtype {jnp.dtype(x.dtype).name}"
        if x.shape[-1] > MAX_WIDTH:
            return f"rows of {x.shape[-1]} values (> {MAX_WIDTH})"
        return None
    return f


def _rows(x):
    return x.reshape(-1, x.shape[-1])


@functools.partial(jax.jit, static_argnames=("eps", "mean", "path", "poison"))
def _rms_norm(x, w, *, eps, mean, path, poison):
    if path == "reference":
        return _ref.rms_norm(x, w, eps, mean)
    with dispatch.poison_outputs(poison):
        return _k.rms_norm(_rows(x), w, eps, mean=mean, interpret=path == "interpret").reshape(x.shape)


def _norm_weight(x, w):
    """``w`` as float32 [n], or [k, n] for x [..., k, n] (a weight per position of x's second-to-last axis, e.g.
    one per hyper-connection stream)."""
    if w is None:
        return None
    w = jnp.asarray(w, jnp.float32)
    if w.ndim == 2:
        if x.ndim < 2 or w.shape != x.shape[-2:]:
            raise UnsupportedError(f"rows.rms_norm: a weight {w.shape} needs x [..., {w.shape[0]}, {w.shape[1]}], "
                                   f"got {x.shape}")
        return w
    return w.reshape(-1)


def rms_norm(x, w, eps: float, *, mean: bool = True, impl: str = "auto"):
    """float32 [..., n]: ``x * rsqrt(mean(x^2) + eps) * w`` per row (module docstring); ``w`` float32 [n], [k, n]
    for x [..., k, n] (row ``(..., j)`` scaled by ``w[j]``, in the same launch), or None.

    Raises:
      UnsupportedError: a [k, n] weight that does not match x's last two axes (or as the module docstring)."""
    path = dispatch.resolve("rows.rms_norm", impl, _why_not(x))
    return _rms_norm(x, _norm_weight(x, w), eps=float(eps), mean=bool(mean), path=path,
                     poison=dispatch.poisoning())


@functools.partial(jax.jit, static_argnames=("eps", "path", "poison"))
def _add_rms_norm(x, r, w, *, eps, path, poison):
    if path == "reference":
        h = x.astype(jnp.float32) + r.astype(jnp.float32)
        return h, _ref.rms_norm(h, w, eps, True)
    with dispatch.poison_outputs(poison):
        h, y = _k.add_rms_norm(_rows(x), _rows(r), w, eps, interpret=path == "interpret")
        return h.reshape(x.shape), y.reshape(x.shape)


def add_rms_norm(x, r, w, eps: float, *, impl: str = "auto"):
    """(h, y), float32 [..., n] each: the residual sum ``h = x + r`` and ``rms_norm(h, w, eps)``, in one launch
    on the kernel path (the bits of the add and of `rms_norm` of h). ``r`` has x's shape.

    Raises:
      UnsupportedError: as `rms_norm`, or r's shape differs from x's."""
    if r.shape != x.shape:
        raise UnsupportedError(f"rows.add_rms_norm: x {x.shape} and r {r.shape} differ")
    path = dispatch.resolve("rows.rms_norm", impl, _why_not(x))
    w = _norm_weight(x, w)
    return _add_rms_norm(x, r, w, eps=float(eps), path=path, poison=dispatch.poisoning())


@functools.partial(jax.jit, static_argnames=("eps", "path", "poison"))
def _hc_write_norm(R, y, inj, w, *, eps, path, poison):
    if path == "reference":
        h = R + y[..., None, :] * inj[..., :, None]
        return h, _ref.rms_norm(h, w, eps, True)
    hc, D = R.shape[-2:]
    with dispatch.poison_outputs(poison):
        h, xn = _k.hc_write_norm(R.reshape(-1, D), y.reshape(-1, D), inj.reshape(-1), w, eps, hc=hc,
                                 interpret=path == "interpret")
        return h.reshape(R.shape), xn.reshape(R.shape)


def hc_write_norm(R, y, inj, w, eps: float, *, impl: str = "auto"):
    """A hyper-connection write and the per-stream RMSNorm of the next read (`strata_jax.layers.hyper`): R float32
    [..., hc, D], y [..., D], inj [..., hc], w [hc*D] or [hc, D] -> (``R + y[..., None, :] * inj[..., :, None]``,
    its `rms_norm` with weight [hc, D]), float32 [..., hc, D] each; one launch on the kernel path (XLA:GPU ran the
    write as an add fusion before the norm's launch). The reference computes the two as written (the bits of
    ``hc_write`` and ``rms_norm``); the kernel's ``R + y * inj`` may be contracted into an FMA (fixed per row).

    Raises:
      UnsupportedError: shapes that do not agree (or as `rms_norm`)."""
    if R.ndim < 2 or y.shape != R.shape[:-2] + R.shape[-1:] or inj.shape != R.shape[:-1]:
        raise UnsupportedError(f"rows.hc_write_norm: R {R.shape}, y {y.shape}, inj {inj.shape}")
    path = dispatch.resolve("rows.rms_norm", impl, _why_not(R))
    w = jnp.asarray(w, jnp.float32).reshape(R.shape[-2:])
    return _hc_write_norm(R.astype(jnp.float32), y.astype(jnp.float32), inj.astype(jnp.float32), w,
                          eps=float(eps), path=path, poison=dispatch.poisoning())


@functools.partial(jax.jit, static_argnames=("eps", "q_scale", "heads", "path", "poison"))
def _qk_l2_norm(q, k, *, eps, q_scale, heads, path, poison):
    h_in, h_out, order = heads
    if path == "reference":
        qn = _ref.rms_norm(q, None, eps, False) * q_scale
        return _ref.to_heads(qn, h_out, order), _ref.to_heads(_ref.rms_norm(k, None, eps, False), h_out, order)
    with dispatch.poison_outputs(poison):
        a, b = _k.qk_l2_norm(_rows(q), _rows(k), eps, q_scale=q_scale, heads=heads, interpret=path == "interpret")
        shape = q.shape[:-2] + (h_out, q.shape[-1])
        return a.reshape(shape), b.reshape(shape)


def qk_l2_norm(q, k, eps: float, *, q_scale: float, heads: int, order: str, impl: str = "auto"):
    """(q', k'), float32 [..., heads, n] each, from q, k [..., h, n]: the bits of ``to_heads(rms_norm(q, None, eps,
    mean=False) * q_scale)`` and ``to_heads(rms_norm(k, None, eps, mean=False))`` on either path, where
    ``to_heads`` repeats the h heads to ``heads`` (``order`` "tiled": head j is head ``j % h``, ``jnp.tile``;
    "grouped": head ``j // (heads / h)``, ``jnp.repeat``) -- the GDN's q / k before the delta rule. One launch on
    the kernel path (each program normalises one q and one k row and writes them to an output head that reads
    them; XLA:GPU otherwise runs two norms, the scale and two broadcasts).

    Raises:
      UnsupportedError: k's shape differs from q's, ``heads`` is not a multiple of h, an unknown ``order`` (or as
        the module docstring)."""
    h = q.shape[-2] if q.ndim >= 2 else 0
    if (k.shape != q.shape or q.ndim < 2 or int(heads) < 1 or int(heads) % max(h, 1)
            or order not in ("tiled", "grouped")):
        raise UnsupportedError(f"rows.qk_l2_norm: q {q.shape}, k {k.shape}, heads={heads}, order={order!r}")
    path = dispatch.resolve("rows.rms_norm", impl, _why_not(q))
    return _qk_l2_norm(q, k, eps=float(eps), q_scale=float(q_scale), heads=(h, int(heads), order), path=path,
                       poison=dispatch.poisoning())


def qk_l2_norm_packed(c, eps: float, *, h: int, n: int, q_scale: float, heads: int, order: str,
                      impl: str = "auto"):
    """`qk_l2_norm` of ``q = c[..., :h*n]`` and ``k = c[..., h*n:2*h*n]`` (as [..., h, n]) of one array c float
    [..., C] (the GDN's convolved q|k|v), the same bits, with the rows read in place on the kernel path: no slice
    launches before the norm (XLA materialises a slice that feeds a Pallas call).

    Raises:
      UnsupportedError: C < 2*h*n, or as `qk_l2_norm`."""
    h, n = int(h), int(n)
    if c.ndim < 2 or c.shape[-1] < 2 * h * n or h < 1 or n < 1 or int(heads) % h or order not in ("tiled", "grouped"):
        raise UnsupportedError(f"rows.qk_l2_norm_packed: c {c.shape}, h={h}, n={n}, heads={heads}, order={order!r}")
    path = dispatch.resolve("rows.rms_norm", impl, _why_not(c))
    return _qk_l2_norm_packed(c, n=n, eps=float(eps), q_scale=float(q_scale), heads=(h, int(heads), order),
                              path=path, poison=dispatch.poisoning())


@functools.partial(jax.jit, static_argnames=("n", "eps", "q_scale", "heads", "path", "poison"))
def _qk_l2_norm_packed(c, *, n, eps, q_scale, heads, path, poison):
    h_in, h_out, _ = heads
    lead, C = c.shape[:-1], c.shape[-1]
    if path == "reference":  # the slices, then `_qk_l2_norm`: its bits
        q = c[..., :h_in * n].reshape(*lead, h_in, n)
        k = c[..., h_in * n:2 * h_in * n].reshape(*lead, h_in, n)
        return _qk_l2_norm(q, k, eps=eps, q_scale=q_scale, heads=heads, path=path, poison=poison)
    flat = c.reshape(-1)
    with dispatch.poison_outputs(poison):  # q rows at offset 0 of each record of C values, k rows at h * n
        a, b = _k.qk_l2_norm(flat, flat, eps, q_scale=q_scale, heads=heads, interpret=path == "interpret",
                             packed=((math.prod(lead) * h_in, n), ((h_in, C, 0), (h_in, C, h_in * n))))
    shape = lead + (h_out, n)
    return a.reshape(shape), b.reshape(shape)


@functools.partial(jax.jit, static_argnames=("fn", "path", "poison"))
def _row_sum(x, w, *, fn, path, poison):
    if path == "reference":
        s = _ref.row_sum(x if w is None else x * w)
        return s if fn is None else _ref.row_map(fn, s)
    with dispatch.poison_outputs(poison):
        return _k.row_sum(_rows(x), interpret=path == "interpret", fn=fn, w=w).reshape(*x.shape[:-1], 1)


def row_sum(x, *, fn=None, w=None, impl: str = "auto"):
    """float32 [..., 1]: the sum of each row (module docstring); with ``w`` [n], of ``x * w`` (the product in the
    same program on the kernel path; the reference sums XLA's product); with ``fn`` (elementwise, hashable),
    ``fn`` of the sum: without ``w`` the bits of ``row_map(fn, row_sum(x))`` on either path, one launch on the
    kernel path (``STRATA_ROW_MAP=xla``: ``fn`` left to XLA, as `row_map` does).

    Raises:
      UnsupportedError: ``w`` not of shape [n] (or as the module docstring)."""
    if w is not None and tuple(w.shape) != tuple(x.shape[-1:]):
        raise UnsupportedError(f"rows.row_sum: w {tuple(w.shape)} for rows of {x.shape[-1]} values")
    path = dispatch.resolve("rows.row_sum", impl, _why_not(x))
    if fn is not None and path == "kernel" and row_map_in_xla():
        return fn(_row_sum(x, w, fn=None, path=path, poison=dispatch.poisoning()))
    return _row_sum(x, w, fn=fn, path=path, poison=dispatch.poisoning())


@functools.partial(jax.jit, static_argnames=("path", "poison"))
def _softmax(x, *, path, poison):
    if path == "reference":
        return _ref.softmax(x)
    with dispatch.poison_outputs(poison):
        return _k.softmax(_rows(x), interpret=path == "interpret").reshape(x.shape)


def softmax(x, *, impl: str = "auto"):
    """float32 [..., n]: softmax of each row (module docstring)."""
    path = dispatch.resolve("rows.softmax", impl, _why_not(x))
    return _softmax(x, path=path, poison=dispatch.poisoning())


@functools.partial(jax.jit, static_argnames=("k", "renorm_min", "path", "poison"))
def _softmax_top_k(x, *, k, renorm_min, path, poison):
    if path == "reference":
        w, ids = jax.lax.top_k(_ref.softmax(x), k)
        if renorm_min is not None:  # one row at a time, as the softmax
            w = _ref.row_map(lambda r: r / jnp.maximum(_ref.row_sum(r), renorm_min), w)
        return w, ids
    with dispatch.poison_outputs(poison):
        w, ids = _k.softmax_top_k(_rows(x), k, interpret=path == "interpret", renorm_min=renorm_min)
        return w.reshape(*x.shape[:-1], k), ids.reshape(*x.shape[:-1], k)


def softmax_top_k(x, k: int, *, renorm_min: float | None = None, impl: str = "auto"):
    """(values float32 [..., k], ids int32 [..., k]): the k largest of each row's `softmax`, in descending order,
    ties to the lower index -- the bits of ``jax.lax.top_k(softmax(x), k)`` on either path, one launch on the
    kernel path (XLA:GPU runs ``top_k`` as a sort and a slice: 2 of the MoE router's launches). With
    ``renorm_min``: the values divided by ``max(sum of the k, renorm_min)`` (the router's renormalisation; in
    the same program on the kernel path, the sum in its fixed tile order; the reference's pairwise `row_sum`).

    Raises:
      UnsupportedError: k outside 1 .. n (or as the module docstring)."""
    if not 1 <= int(k) <= x.shape[-1]:
        raise UnsupportedError(f"rows.softmax_top_k: k={k} for rows of {x.shape[-1]} values")
    path = dispatch.resolve("rows.softmax", impl, _why_not(x))
    return _softmax_top_k(x, k=int(k), renorm_min=None if renorm_min is None else float(renorm_min), path=path,
                          poison=dispatch.poisoning())


@functools.partial(jax.jit, static_argnames=("fn", "path", "poison"))
def _row_map(x, *, fn, path, poison):
    if path == "reference":
        return _ref.row_map(fn, x.astype(jnp.float32))
    with dispatch.poison_outputs(poison):
        return _k.row_map(fn, _rows(x), interpret=path == "interpret").reshape(x.shape)


def row_map_in_xla() -> bool:
    """``STRATA_ROW_MAP=xla``: on the compiled kernel path (a GPU) `row_map` leaves ``fn`` to XLA's fusions instead
    of one Pallas launch (the narrow-row hazard is XLA:CPU's vector remainder; whether XLA:GPU's elementwise code
    is as row-invariant is what the switch lets a device run check, with the launches it saves). Default
    ``kernel``."""
    return dispatch.env_choice("STRATA_ROW_MAP", "kernel", ("kernel", "xla")) == "xla"


def row_map(fn, x, *, impl: str = "auto"):
    """float32 [..., n]: ``fn`` (elementwise, hashable: e.g. ``jax.nn.sigmoid``) applied one row at a time
    (on the compiled kernel path under ``STRATA_ROW_MAP=xla``: ``fn(x)`` as XLA fuses it)."""
    path = dispatch.resolve("rows.row_map", impl, _why_not(x))
    if path == "kernel" and row_map_in_xla():
        return fn(x.astype(jnp.float32))
    return _row_map(x, fn=fn, path=path, poison=dispatch.poisoning())


@functools.partial(jax.jit, static_argnames=("fn", "n_out", "path", "poison"))
def _row_map_multi(xs, params, *, fn, n_out, path, poison):
    if path == "reference":
        return _ref.row_map_multi(fn, xs, params, n_out)
    with dispatch.poison_outputs(poison):
        outs = _k.row_map_multi(fn, tuple(_rows(x) for x in xs), params, n_out=n_out,
                                interpret=path == "interpret")
        outs = tuple(o.reshape(xs[0].shape) for o in (outs if n_out > 1 else (outs,)))
        return outs if n_out > 1 else outs[0]


def row_map_multi(fn, xs, params=(), *, n_out: int = 1, impl: str = "auto"):
    """`row_map` of several operands: ``fn(*rows, *params)`` (elementwise, hashable) for each row of ``xs`` (a
    tuple of float [..., n] of one shape) with ``params`` (a tuple of float [n], the same for every row; e.g. a
    layer's per-head bias), returning ``n_out`` float32 [..., n] (a tuple when > 1): one Pallas program per row on
    the kernel path, one launch for all of them (`row_map`'s per-lane code: what ``fn`` computes of a lane depends
    on that lane only); ``lax.map`` over rows on the reference; ``STRATA_ROW_MAP=xla``: ``fn`` as XLA fuses it.

    Raises:
      UnsupportedError: operands of different shapes, params not [n] (or as the module docstring)."""
    xs, params = tuple(xs), tuple(params)
    n = xs[0].shape[-1]
    if any(x.shape != xs[0].shape for x in xs) or any(tuple(p.shape) != (n,) for p in params) or n_out < 1:
        raise UnsupportedError(f"rows.row_map_multi: operands {[x.shape for x in xs]}, params "
                               f"{[p.shape for p in params]}, n_out={n_out}")
    path = dispatch.resolve("rows.row_map", impl, _why_not(xs[0]))
    if path == "kernel" and row_map_in_xla():
        return fn(*(x.astype(jnp.float32) for x in xs), *(p.astype(jnp.float32) for p in params))
    return _row_map_multi(xs, params, fn=fn, n_out=int(n_out), path=path, poison=dispatch.poisoning())

