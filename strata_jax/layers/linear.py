"""Linear maps and embeddings whose weights stay in their GGUF block format on the device.

A weight ``[n_out, n_in]`` is held as the file's bytes (uint8 ``[n_out, row_bytes]``) for block formats, or as its
float dtype for F32/F16/BF16; it is dequantized inside the matmul (`strata_jax.pallas.quant_matmul.qmatmul`).
Under ``STRATA_QMATMUL=planar`` (the default) with the Pallas kernels in use, block formats are repacked at load
into the planar device layout instead (`strata_jax.pallas.quant_matmul.prepare_weight`: uint32, exact, the same
values); ``STRATA_QMATMUL=bytes`` keeps the file's bytes for the GGUF-bytes kernel.

Inside ``with blocks_as_f32():`` (what `strata_jax.pipeline.engine.Engine` does on a CPU when the copy fits, its
``weights="f32"``), block-format tensors are dequantized once at load instead (`strata_jax.gguf.blocks.dequantize`,
the same decoder the matmul runs, so the values are the same) and held as float32 with qtype F32: four or more
times the memory, but XLA on a CPU then reads plain floats instead of unpacking blocks on every step.

Every tensor is loaded through `load_raw`, and every caller states the logical shape it expects from the config (in
`strata_jax.config.Dim` s naming their metadata keys), as llama.cpp's loader does (``create_tensor(name, {dims})``,
``check_tensor_dims``): `check_tensor`, the one check, refuses a missing tensor, a block format the engine cannot
read, a shape that disagrees with the metadata, or a format wrong for the tensor's role (norms and other vectors
read with `load_f32` must be float), with one `StrataError` line naming the file, the tensor and the keys.
Inside ``with dry_run():`` the loaders check and return abstract arrays without reading data, so a whole stage can
be checked before anything is placed (`strata_jax.models.registry.check_stages`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf.constants import GGMLQuantizationType as Q

from strata_jax.errors import StrataError, UnsupportedError
from strata_jax.gguf import blocks
from strata_jax.pallas.quant_matmul import dequantize_weight, prepare_weight, qmatmul, qmatmul_shared
from strata_jax.state import Rows

_FLOAT_DTYPES = {Q.F32: np.float32, Q.F16: np.float16}
FLOAT_FORMATS = frozenset({Q.F32, Q.F16, Q.BF16})
_LOAD = threading.local()
_DEQUANT_ROWS = 4096  # rows dequantized per call at load (bounds the decoder's temporaries)


@contextlib.contextmanager
def _loading(**settings):
    """Set this thread's load settings (`blocks_as_f32`, `load_progress`, `dry_run`) for the context, then restore
    them."""
    old = {k: getattr(_LOAD, k, None) for k in settings}
    for k, v in settings.items():
        setattr(_LOAD, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(_LOAD, k, v)


def blocks_as_f32(enabled: bool = True):
    """Within this context `load_raw` returns block-format tensors dequantized to float32 (qtype F32); see the
    module docstring. Float formats are left as stored."""
    return _loading(f32=bool(enabled))


def load_progress(callback):
    """Within this context `load_raw` calls ``callback(nbytes)`` after placing each tensor, with the bytes it read
    from the file (a progress bar over the bytes loaded). None: no calls."""
    return _loading(progress=callback)


def _loaded(info) -> None:
    cb = getattr(_LOAD, "progress", None)
    if cb is not None:
        cb(int(getattr(info, "nbytes", 0) or 0))


@functools.partial(jax.jit, static_argnames=("qtype", "n_cols"))
def _dequant_chunk(raw, *, qtype, n_cols):
    return blocks.dequantize(raw, qtype, n_cols)


def _dequantize_rows(raw: np.ndarray, qtype, n_cols: int, device) -> jax.Array:
    """uint8 [rows..., row_bytes] -> float32 [rows..., n_cols] on ``device``, in chunks of `_DEQUANT_ROWS` rows."""
    lead = raw.shape[:-1]
    flat = raw.reshape(-1, raw.shape[-1])
    out = np.empty((flat.shape[0], n_cols), np.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        for r0 in range(0, flat.shape[0], _DEQUANT_ROWS):
            chunk = flat[r0:r0 + _DEQUANT_ROWS]
            n = chunk.shape[0]
            if n < _DEQUANT_ROWS and flat.shape[0] > _DEQUANT_ROWS:  # pad the tail: one compiled shape per format
                chunk = np.concatenate([chunk, np.zeros((_DEQUANT_ROWS - n, chunk.shape[1]), np.uint8)])
            out[r0:r0 + n] = np.asarray(_dequant_chunk(jnp.asarray(chunk), qtype=qtype, n_cols=n_cols))[:n]
    return jax.device_put(out.reshape(*lead, n_cols), device)


def dry_run():
    """Within this context (run under `flax.nnx.eval_shape`) `load_raw` checks each tensor (`check_tensor`) and
    returns zeros of the shape and dtype it would load, reading no data: a stage built so is checked whole before
    any weight is placed (`strata_jax.models.registry.check_stages`)."""
    return _loading(dry=True)


def _shape_text(shape) -> str:
    return "[" + ", ".join("*" if d is None else str(int(d)) for d in shape) + "]"


def check_tensor(g, name: str, shape, formats=None, reshape: bool = False) -> tuple[int, ...]:
    """The one check of a tensor against what the metadata says (llama.cpp's ``check_tensor_dims``).

    Args:
      g: the open GGUF (`strata_jax.gguf.GGUFFile` or a `strata_jax.testing.random_weights.VirtualGGUF`).
      name: the tensor.
      shape: the logical shape the caller expects (numpy order, ``(n_out, n_in)`` for a matrix), its entries ints,
        `strata_jax.config.Dim` s (their keys are named in the message) or None (any size). The stored shape must
        equal it; extra leading dims must be 1 (``[1, D]`` for an expected ``[D]``, as ggml allows).
      formats: the block formats allowed for the tensor's role (None: any format the engine reads).
      reshape: only the element count must match (llama.cpp's ``TENSOR_ALLOW_RESHAPE``: a vector stored as
        ``[hc, D]`` for an expected ``[hc * D]``); ``shape`` must then have no None.

    Returns:
      The shape to read the tensor at: the stored one without the extra leading 1s, or ``shape`` with ``reshape``.

    Raises:
      StrataError: one line naming the file and the tensor: missing; ``has shape [a, b], the metadata expects [c, d]
        (from <arch>.<key>=<value>, ...)``; stored in a format outside ``formats``.
      UnsupportedError: a block format the engine cannot read.
    """
    info = g.info(name)
    if info.qtype not in blocks.SUPPORTED:
        raise UnsupportedError(f"{g.path}: unsupported block format {blocks.format_name(info.qtype)} for tensor "
                               f"{name!r}")
    got, want = tuple(info.shape), tuple(shape)
    lead = len(got) - len(want)
    reshape = reshape and None not in want
    if reshape:
        ok = math.prod(got) == math.prod(want)
    else:
        ok = lead >= 0 and all(d == 1 for d in got[:lead]) and all(w is None or w == d
                                                                    for w, d in zip(want, got[lead:]))
    if not ok:
        src = []
        for w in want:
            src += [s for s in getattr(w, "src", ()) if s not in src]
        raise StrataError(f"{g.path}: tensor {name!r} has shape {_shape_text(got)}, the metadata expects "
                          f"{_shape_text(want)}" + (f" (from {', '.join(src)})" if src else ""))
    if formats is not None and info.qtype not in formats:
        allowed = ", ".join(blocks.format_name(f) for f in sorted(formats, key=int))
        raise StrataError(f"{g.path}: tensor {name!r} is stored as {blocks.format_name(info.qtype)}; its role takes "
                          f"only {allowed}")
    return tuple(int(w) for w in want) if reshape else got[lead:]


def load_raw(g, name: str, device=None, *, shape, formats=None, reshape: bool = False):
    """A tensor's data as stored, placed on ``device`` (no dequantization), after `check_tensor` (``shape``: the
    logical shape the caller expects from the config; ``formats``: the block formats its role allows; ``reshape``:
    any stored shape of as many values, read at ``shape``).

    Returns:
      (array, qtype, shape): uint8 [rows..., row_bytes] for block formats, float32/float16/bfloat16 [shape] for
      float formats; within `blocks_as_f32`, block formats come as (float32 [shape], F32, shape). ``shape`` is the
      stored one at the expected rank.

    Raises:
      StrataError: missing tensor, a shape that disagrees with ``shape``, a format outside ``formats``;
      UnsupportedError: a block format the engine cannot read.
    """
    shape = check_tensor(g, name, shape, formats, reshape)
    qtype = g.info(name).qtype
    if getattr(_LOAD, "dry", False):
        if qtype in FLOAT_FORMATS:
            dt = jnp.bfloat16 if qtype == Q.BF16 else _FLOAT_DTYPES[qtype]
            return jnp.zeros(shape, dt), qtype, shape
        return jnp.zeros((*shape[:-1], blocks.row_bytes(qtype, shape[-1])), jnp.uint8), qtype, shape
    out = _place(g, name, qtype, shape, device)
    _loaded(g.info(name))
    return out


def _place(g, name: str, qtype, shape, device):
    if getattr(g, "virtual", False):  # random weights drawn on the device (strata_jax.testing.random_weights)
        raw = g.tensor_bytes(name, device)
        if qtype in FLOAT_FORMATS:
            dt = jnp.bfloat16 if qtype == Q.BF16 else _FLOAT_DTYPES[qtype]
            raw = jax.lax.bitcast_convert_type(raw.reshape(*shape, jnp.dtype(dt).itemsize), dt)
        else:
            raw = raw.reshape(*shape[:-1], raw.shape[-1])
        return raw, qtype, shape
    raw = g.tensor_bytes(name)
    if qtype in _FLOAT_DTYPES:
        arr = raw.view(_FLOAT_DTYPES[qtype]).reshape(shape)
    elif qtype == Q.BF16:
        arr = jnp.asarray(raw.view(np.uint16).reshape(shape)).view(jnp.bfloat16)
        return jax.device_put(arr, device), qtype, shape
    else:
        arr = raw.reshape(*shape[:-1], raw.shape[-1])
        if getattr(_LOAD, "f32", False):
            return _dequantize_rows(np.asarray(arr), qtype, int(shape[-1]), device), Q.F32, shape
    return jax.device_put(np.ascontiguousarray(arr), device), qtype, shape


def load_f32(g, name: str, device=None, *, shape) -> jax.Array:
    """A small tensor as float32 [shape] on ``device``: norms, biases, gates, conv weights. Its role needs a float
    format (F32, F16 or BF16: what llama.cpp's converters write for them); ``shape`` as `load_raw`; a vector
    (1-D ``shape``) may be stored in any shape of as many values (its order is the same)."""
    arr, qtype, shape = load_raw(g, name, device, shape=shape, formats=FLOAT_FORMATS, reshape=len(shape) == 1)
    return jnp.asarray(arr, jnp.float32).reshape(shape)


class QLinear(nnx.Module):
    """``y = x @ W.T (+ b)`` with W kept in its block format.

    Attributes:
      w: the weight as stored (see module docstring).
      qtype: its ggml block format.
      n_out, n_in: the logical shape of W.
      b: optional float32 bias [n_out].
      precise: the prefill GEMM keeps the float32-like precision (`strata_jax.pallas.quant_matmul.precision`'s
        ``precise``: for a projection whose error a recurrence amplifies, GDN's q/k/v).
    """

    def __init__(self, w, qtype, n_out: int, n_in: int, b=None, precise: bool = False):
        self.w = w if isinstance(w, nnx.Param) else nnx.Param(w)  # a Param may be shared (tied head)
        self.qtype = qtype
        self.n_out = int(n_out)
        self.n_in = int(n_in)
        self.b = nnx.Param(b) if b is not None else None
        self.precise = bool(precise)

    @classmethod
    def from_gguf(cls, g, name: str, device=None, bias: str | None = None, *, shape,
                  precise: bool = False) -> "QLinear":
        """W from tensor ``name``, expected ``shape`` = ``(n_out, n_in)`` (`load_raw`), and the bias [n_out] from
        tensor ``bias`` when the file has it. W is put in its device form (`prepare_weight`); ``precise`` as the
        attribute."""
        w, qtype, shape = load_raw(g, name, device, shape=shape)
        b = load_f32(g, bias, device, shape=(shape[0],)) if bias and g.has(bias) else None
        return cls(prepare_weight(w, qtype, shape[1]), qtype, shape[0], shape[1], b, precise)

    @classmethod
    def stacked(cls, linears, n_out: int | None = None) -> "QLinear | None":
        """One `QLinear` whose output rows are those of ``linears`` in order (W and the biases concatenated along
        n_out; a missing bias is zeros), so that projections of one input take one launch and one read of it; with
        ``n_out`` larger than their sum, zero rows after them (every stored form's all-zero row is a zero row: a
        block of zero bytes has scale 0). None when they differ in format, n_in or stored form (dtype, row width):
        the caller keeps them apart. Every stored form keeps one matrix row per leading index (GGUF bytes, planar
        words, floats), so output row r is row r of its own matrix; the bits may differ from the separate call's
        (a kernel's launch config, e.g. its K split, is a function of n_out), never between row counts.

        Raises: ValueError: ``n_out`` below the rows of ``linears``."""
        first = linears[0]
        ws = [lin.w[...] for lin in linears]
        if any(lin.qtype != first.qtype or lin.n_in != first.n_in or w.dtype != ws[0].dtype
               or w.ndim != 2 or w.shape[1:] != ws[0].shape[1:] for lin, w in zip(linears, ws)):
            return None
        rows = sum(lin.n_out for lin in linears)
        n_out = rows if n_out is None else int(n_out)
        if n_out < rows:
            raise ValueError(f"QLinear.stacked: n_out {n_out} is below the {rows} rows of the parts")
        if n_out > rows:
            ws.append(jnp.zeros((n_out - rows, ws[0].shape[1]), ws[0].dtype))
        b = None
        if any(lin.b is not None for lin in linears):
            b = jnp.concatenate([lin.b[...] if lin.b is not None else jnp.zeros((lin.n_out,), jnp.float32)
                                 for lin in linears] + [jnp.zeros((n_out - rows,), jnp.float32)])
        return cls(jnp.concatenate(ws, axis=0), first.qtype, n_out, first.n_in, b,
                   any(lin.precise for lin in linears))

    def padded_k(self, n_in: int) -> "QLinear | None":
        """The same map on inputs widened to ``n_in`` (zero columns after W's: inputs there add exact zeros for
        finite values), for a float-stored W [n_out, K] (F32 / F16 / BF16, or blocks dequantized at load); None for
        block formats (their columns come in blocks). Raises ValueError: ``n_in`` below K."""
        w = self.w[...]
        if n_in < self.n_in:
            raise ValueError(f"QLinear.padded_k: n_in {n_in} is below K = {self.n_in}")
        if self.qtype not in FLOAT_FORMATS or w.dtype == jnp.uint8 or w.ndim != 2:
            return None
        w = jnp.concatenate([w, jnp.zeros((w.shape[0], n_in - self.n_in), w.dtype)], axis=1)
        return QLinear(w, self.qtype, self.n_out, n_in, self.b[...] if self.b is not None else None, self.precise)

    def __call__(self, x: jax.Array, exact_rows: bool = True) -> jax.Array:
        """x float [..., n_in] -> float32 [..., n_out].

        Each row's arithmetic is independent of the other rows and of the row count (`qmatmul`'s contract), which
        makes verify windows and batch rows exact. ``exact_rows`` (verify windows; the default): on the Pallas
        kernel path, more than 8 rows (windows of several segments) run as 8-row groups of the kernel, so every row
        gets the bits of the row alone; ``False`` (prefill chunks): the GEMM at any row count (at the precision
        ``precise`` picks), so the head's last prompt rows (``head_logits``' "last") get the bits they get among all
        of a chunk's rows ("all")."""
        lead = x.shape[:-1]
        y = qmatmul(x.reshape(-1, self.n_in), self.w[...], self.qtype, self.n_out, self.n_in, row_groups=exact_rows,
                    precise=self.precise, prefill=not exact_rows)
        y = y.reshape(*lead, self.n_out)
        if self.b is not None:
            y = y + self.b[...]
        return y


def project_shared(x: jax.Array, linears, exact_rows: bool = True) -> tuple:
    """``tuple(lin(x, exact_rows) for lin in linears)``, bit for bit, where the projections of one format and
    shape (a gated MLP's gate and up; K and V of one format) share one kernel launch and one read of ``x``
    (`strata_jax.pallas.quant_matmul.qmatmul_shared`: the planar GEMV of 1..8 window rows or row groups; every
    other path makes the separate calls).

    Args: x float [..., n_in] (every linear's ``n_in``); linears: a sequence of `QLinear`.
    Returns: a tuple of float32 [..., n_out] in the order of ``linears``.
    """
    lead = x.shape[:-1]
    out = [None] * len(linears)
    groups: dict = {}
    for i, lin in enumerate(linears):
        w = lin.w[...]
        groups.setdefault((int(lin.qtype), lin.n_out, lin.n_in, w.dtype, w.shape, lin.precise), []).append(i)
    for (_, n_out, n_in, _, _, precise), idx in groups.items():
        x2 = x.reshape(-1, n_in)
        ys = qmatmul_shared(x2, [linears[i].w[...] for i in idx], linears[idx[0]].qtype, n_out, n_in,
                            row_groups=exact_rows, precise=precise, prefill=not exact_rows)
        for i, y in zip(idx, ys):
            y = y.reshape(*lead, n_out)
            out[i] = y + linears[i].b[...] if linears[i].b is not None else y
    return tuple(out)


class Embedding(nnx.Module):
    """Token embedding rows gathered from the stored table and dequantized per row.

    Attributes:
      w: [vocab, row_bytes] uint8 (or float [vocab, D]); qtype; dim D.
    """

    def __init__(self, w, qtype, vocab: int, dim: int, scale: float = 1.0):
        self.w = nnx.Param(w)
        self.qtype = qtype
        self.vocab = int(vocab)
        self.dim = int(dim)
        self.scale = float(scale)

    @classmethod
    def from_gguf(cls, g, name: str, device=None, scale: float = 1.0, *, shape) -> "Embedding":
        """The table from tensor ``name``, expected ``shape`` = ``(vocab, D)`` (`load_raw`), in its device form
        (`prepare_weight`: a tied head reads it)."""
        w, qtype, shape = load_raw(g, name, device, shape=shape)
        return cls(prepare_weight(w, qtype, shape[1]), qtype, shape[0], shape[1], scale)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids int32 [...] -> float32 [..., D] (times ``scale``)."""
        rows = jnp.take(self.w[...], jnp.clip(ids, 0, self.vocab - 1), axis=0)
        e = dequantize_weight(rows, self.qtype, self.dim)
        return e * self.scale if self.scale != 1.0 else e

    def as_linear(self) -> QLinear:
        """The tied output head: the same stored table used as ``[vocab, D]`` weights."""
        return QLinear(self.w, self.qtype, self.vocab, self.dim)


def head_logits(head, norm, h, rows: Rows, mode: str, which: str):
    """Logits float32 of every row (``which="all"``, [B, T, V]) or of each segment's last valid row (``"last"``,
    [B, 1, V], so that a long prefill chunk does not build [T, V] logits). ``h`` [B, T, ...] (any trailing shape
    ``norm`` takes); the head's matmul is row-exact in windows (``mode == "window"``) and in prefill the GEMM at
    any row count, so "last" gives a row the bits "all" gives it. Used by every family."""
    if which == "last":
        idx = jnp.clip(rows.n_valid - 1, 0, h.shape[1] - 1)
        idx = idx.reshape((-1, 1) + (1,) * (h.ndim - 2))
        h = jnp.take_along_axis(h, idx, axis=1)
    return head(norm(h), mode == "window")
