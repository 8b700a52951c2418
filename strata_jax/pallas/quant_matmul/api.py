"""Public API: `qmatmul`, a matmul of activations by a GGUF block-quantized weight matrix.

Source: GGUF block layouts from ggml (``ggml/src/ggml-common.h`` structs, ``dequantize_row_*`` in
``ggml/src/ggml-quants.c``); the formats the shipped GGUF models use.

``qmatmul(x, w_raw, qtype, n_out, k_in, *, impl="auto", row_groups=False, precise=False, prefill=False)``
``-> float32 [M, n_out]``

* ``x``: [M, k_in] float32 / bfloat16 / float16 activations (M = verify-window rows, or prefill tokens).
* ``w_raw``: the GGUF matrix of logical shape [n_out, k_in] (numpy order; ggml ``ne`` = [k_in, n_out]) as stored:
  uint8 [n_out, row_bytes] for a block format (``row_bytes = k_in / values_per_block * bytes_per_block``), or
  float32 / float16 / bfloat16 [n_out, k_in] (or their raw bytes) for F32 / F16 / BF16.
* ``qtype``: `gguf.GGMLQuantizationType` (or its int id); ``n_out``, ``k_in``: Python ints.
* Result: ``y[m, n] = sum_k x[m, k] * W[n, k]`` with W the dequantized weight, accumulated in float32.
* ``row_groups``: let the kernel serve M > 8 rows as groups of 8 rows of the GEMV in one launch (the weight is read
  once per group): every row then gets the GEMV's bits whatever M is. For verify windows of several segments
  (B * T > 8 rows), which must give each row the bits of the row alone. Without it, M > 8 rows (or any M with
  ``prefill``) take the kernel's GEMM (the same bits for a row whatever M is, but not the GEMV's).
* ``prefill``: the rows are (part of) a prefill chunk: the GEMM at any M, also for M <= 8 (the last prompt rows the
  output head reads), so a row's bits never depend on how many rows the call has (not with ``row_groups``).
* ``precise``: the planar GEMM of such chunks keeps `gemm.PRECISE_PRECISION` (bf16x2) instead of the default f16
  products (`precision`); for a projection whose error a recurrence amplifies (`QLinear.precise`).

Paths (``impl``, see `strata_jax.pallas.dispatch`): the reference dequantizes with `strata_jax.gguf.blocks` and
multiplies in fixed 8-row chunks at HIGHEST precision; the kernel (formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, F32, F16, BF16; any M: the GEMV for 1..8 rows and for 8-row groups, the GEMM for prefill)
decodes in registers and reads each weight byte once per row group. The two are not bit-identical (different
summation order); each is row-independent (row m of an M-row call == the row alone, bit for bit: the kernel's
GEMV for M <= 8 and with row groups for any M, its GEMM among GEMM calls of any M, the reference for any M) and
within ~1e-5 relative of a float64 product.

Planar weights (``STRATA_QMATMUL=planar``, the default; ``bytes`` selects the kernel above):
`prepare_weight` repacks a block-format matrix at load into the planar device layout
(`strata_jax.pallas.quant_matmul.planar`: uint32 [n_out, row_words], exact) when the kernel path is in use, and
``qmatmul`` then runs the planar kernels: for 1..8 window rows (and row groups) the float32 GEMV
(`strata_jax.pallas.quant_matmul.gemv`; ``STRATA_QMATMUL_GEMV=tc``: the tensor-core tiles of `gemm`; ``tc16``: the
tensor-core GEMV `strata_jax.pallas.quant_matmul.tcgemv`, 16-row tiles), for prefill rows (any M) and more than 8
rows without row groups the tensor-core GEMM (`strata_jax.pallas.quant_matmul.gemm`; ``STRATA_QMATMUL_GEMM``:
``kblock``, the default, dequantizes a block of K values per step and multiplies whole blocks; ``unit``, the kernel
before, one scale unit per step) at ``STRATA_QMATMUL_PRECISION`` (``f16``, the GEMM's default: one float16 product
in the K-block GEMM; or bfloat16 pieces per operand: ``bf16x2``, the default of ``precise=True`` calls, ``bf16x3``,
the tensor-core GEMVs', or ``bf16``; `precision`).
F16 / BF16 / F32 weights take the same planar kernels under the variable. The weight's dtype says which kernel
family serves it, so a weight loaded under one setting keeps working under another; on the
reference path a planar weight is decoded by `planar.dequantize` (the same values as the GGUF bytes). Formats:
every block format of `planar.FORMATS` (Q4_0 ... Q6_K and IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
IQ4_NL, IQ4_XS).

``qmatmul_shared(x, ws, qtype, n_out, k_in, ...)``: the same products for several weights of one format and
shape that read the same ``x`` (a gated MLP's gate and up, K and V of one format); on the planar float32 GEMV they
share one launch (``STRATA_QMATMUL_SHARED=0``: one call each), each output the bits of its own `qmatmul` call.

Accuracy of the planar paths: the GEMV (1..8 rows, row groups) ~1e-6 relative (float32 products); the prefill GEMM
at its default f16 products ~1e-4 of ``|x| @ |W|`` per output, at bf16x2 ~1e-6. The GEMV's launch configs come from
a measured table per format and shape (`gemv.choose_config`; ``STRATA_QMATMUL_GEMV_CONFIGS`` picks the table, read
when a call is traced, like the other switches here: within one process a change needs ``jax.clear_caches()``).

Errors: `strata_jax.errors.UnsupportedError` for shape mismatches, formats `strata_jax.gguf.blocks` cannot decode,
or impl="kernel"/"interpret" where the kernel cannot serve (format without a kernel, K not a multiple of the
sub-block, a weight of 2 GiB or more); `StrataError` from `blocks.dequantize` for a wrong byte width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from strata_jax.errors import UnsupportedError
from strata_jax.gguf import blocks
from strata_jax.pallas import dispatch
from strata_jax.pallas.quant_matmul import gemm as _gemm
from strata_jax.pallas.quant_matmul import gemv as _gemv
from strata_jax.pallas.quant_matmul import kernel as _k
from strata_jax.pallas.quant_matmul import planar as _planar
from strata_jax.pallas.quant_matmul import reference as _ref
from strata_jax.pallas.quant_matmul import tcgemv as _tcgemv
from strata_jax.pallas.quant_matmul.formats import FLOAT_TYPES

KERNEL_FORMATS = frozenset(_k.FORMATS) | frozenset(FLOAT_TYPES)
PLANAR_FORMATS = frozenset(_planar.FORMATS) | frozenset(FLOAT_TYPES)
VARIANTS = ("bytes", "planar")
GEMV_VARIANTS = ("fma", "tc", "tc16")


def variant() -> str:
    """``STRATA_QMATMUL``: ``planar`` (default: weights repacked at load, `prepare_weight`; the planar kernels) or
    ``bytes`` (the kernel on the GGUF bytes). Read at load and when a call is traced. Planar is the default since
    the H200 run of 2026-12-02 (1.5B shape, same call: decode 229.7 vs 212.2 tok/s, prefill 1,527 vs 1,109 tok/s;
    experiments/RESULTS.md)."""
    return dispatch.env_choice("STRATA_QMATMUL", "planar", VARIANTS)


def gemv_variant() -> str:
    """``STRATA_QMATMUL_GEMV``: the planar GEMV of 1..8 rows (and of row groups), ``fma`` (float32 on the CUDA
    cores, default), ``tc`` (`gemm`'s tensor-core tiles, 8-row groups padded to 16) or ``tc16`` (`tcgemv`: the
    tensor-core GEMV, 16-row tiles, activation pieces cut once outside the kernel), both at `precision`. The
    grouped experts take ``tc`` as is and serve ``tc16`` with ``fma``."""
    return dispatch.env_choice("STRATA_QMATMUL_GEMV", "fma", GEMV_VARIANTS)


def shared_launch() -> bool:
    """``STRATA_QMATMUL_SHARED``: ``1`` (default) lets `qmatmul_shared` put projections of one format and shape
    in one launch; ``0`` makes one call each (the same bits: for timing the two side by side)."""
    return dispatch.env_choice("STRATA_QMATMUL_SHARED", "1", ("0", "1")) == "1"


def gemm_variant() -> str:
    """``STRATA_QMATMUL_GEMM``: the kernel of the planar tensor-core GEMM (prefill chunks, MoE prefill,
    ``STRATA_QMATMUL_GEMV=tc``): ``kblock`` (default; 1.2-2.2x ``unit`` on the H100: see `gemm.DEFAULT_VARIANT`)
    or ``unit`` (`gemm.gemm_variant`). Read when a call is traced, and a static argument of the jitted call."""
    return _gemm.gemm_variant()


def precision(gemm: bool = True, precise: bool = False) -> str:
    """``STRATA_QMATMUL_PRECISION``: the bfloat16 pieces of each inexact operand in the planar tensor-core kernels
    (`gemm.PRECISIONS`: the activations in ``unit`` and tc16, the activations and dequantized weights in
    ``kblock``), or ``f16`` (`gemm.F16`: one float16 product in the kblock GEMM; the tensor-core GEMVs keep
    `gemm.GEMV_PRECISION`); set (non-empty), it applies to every call. Unset: `gemm.DEFAULT_PRECISION` (``f16``)
    for the GEMM of prefill chunks and MoE prefill's grouped experts (``gemm``), `gemm.PRECISE_PRECISION`
    (``bf16x2``) for a GEMM whose error a recurrence amplifies (``gemm`` and ``precise``: `QLinear.precise`,
    GDN's q/k/v projection), `gemm.GEMV_PRECISION` (``bf16x3``) for the tensor-core GEMVs of decode rows.

    Raises:
      UnsupportedError: ``STRATA_QMATMUL_PRECISION`` is not one of `gemm.GEMM_PRECISIONS`."""
    default = (_gemm.PRECISE_PRECISION if precise else _gemm.DEFAULT_PRECISION) if gemm else _gemm.GEMV_PRECISION
    value = dispatch.env_choice("STRATA_QMATMUL_PRECISION", default, _gemm.GEMM_PRECISIONS)
    return value if gemm else _gemm.gemv_precision(value)


def prepare_weight(w, qtype, n_cols: int):
    """The device form of a loaded matrix [..., rows, row_bytes] (uint8 GGUF blocks, or floats): repacked to the
    planar layout when ``STRATA_QMATMUL=planar``, the Pallas kernels are in use (`dispatch.kernels_in_use`) and
    the format has a planar form; otherwise ``w`` unchanged. Called at load time (`strata_jax.layers.linear`)."""
    qtype = blocks.check_supported(qtype)
    if (variant() != "planar" or not dispatch.kernels_in_use() or qtype not in _planar.FORMATS
            or getattr(w, "dtype", None) != jnp.uint8 or n_cols % _planar.GROUP):
        return w
    return _planar.repack(w, qtype=qtype, n_cols=n_cols)


def uses_planar_kernels(w, qtype, k_in: int) -> bool:
    """Whether calls on this weight go to the planar kernels (a planar matrix; or a float matrix under
    ``STRATA_QMATMUL=planar`` with K a multiple of 32)."""
    if _planar.is_planar(w, qtype):
        return True
    return qtype in FLOAT_TYPES and variant() == "planar" and k_in % _planar.GROUP == 0


def _as_float_weight(w_raw, qtype, k_in):
    """F32/F16/BF16 given as raw bytes -> the typed array the kernel reads."""
    if qtype in FLOAT_TYPES and w_raw.dtype == jnp.uint8:
        dt = jnp.dtype(FLOAT_TYPES[qtype])
        return jax.lax.bitcast_convert_type(w_raw.reshape(w_raw.shape[0], k_in, dt.itemsize), dt)
    return w_raw


def check_args(x, w_raw, qtype, n_out, k_in, op="quant_matmul.qmatmul"):
    """Validate shapes; returns qtype as a `GGMLQuantizationType`."""
    qtype = blocks.check_supported(qtype)
    if x.ndim != 2 or x.shape[1] != k_in:
        raise UnsupportedError(f"{op}: x has shape {x.shape}, expected [M, {k_in}]")
    if w_raw.ndim != 2 or w_raw.shape[0] != n_out:
        raise UnsupportedError(f"{op}: weight has shape {w_raw.shape}, expected [{n_out}, row]")
    if _planar.is_planar(w_raw, qtype):
        rw = _planar.row_words(qtype, k_in)
        if w_raw.shape[1] != rw:
            raise UnsupportedError(f"{op}: planar {qtype.name} weight must be uint32 [{n_out}, {rw}], "
                                   f"got {w_raw.shape}")
    elif qtype in FLOAT_TYPES and w_raw.dtype != jnp.uint8:
        if w_raw.shape[1] != k_in:
            raise UnsupportedError(f"{op}: {qtype.name} weight has shape {w_raw.shape}, expected [{n_out}, {k_in}]")
    else:
        rb = blocks.row_bytes(qtype, k_in)
        if w_raw.dtype != jnp.uint8 or w_raw.shape[1] != rb:
            raise UnsupportedError(f"{op}: {qtype.name} weight must be uint8 [{n_out}, {rb}], "
                                   f"got {w_raw.dtype} {w_raw.shape}")
    return qtype


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "k_in", "path", "gemm", "poison", "gemv", "prec",
                                             "gemm_kernel"))
def _qmatmul_planar(x, w, *, qtype, n_out, k_in, path, gemm, poison, gemv, prec, gemm_kernel):
    if path == "reference":
        return _ref.matmul_rows(x, _ref.dequantize_weight(_as_float_weight(w, qtype, k_in), qtype, k_in))
    interpret = path == "interpret"
    w = _as_float_weight(w, qtype, k_in)
    with dispatch.poison_outputs(poison):
        if gemm:
            return _gemm.gemm(x, w, qtype, n_out, k_in, interpret=interpret, precision=prec, variant=gemm_kernel)
        if gemv == "tc":
            return _gemm_rows_tc(x, w, qtype, n_out, k_in, interpret=interpret, precision=prec,
                                 variant=gemm_kernel)
        if gemv == "tc16":
            return _tcgemv.gemv(x, w, qtype, n_out, k_in, interpret=interpret, precision=prec)
        return _gemv.gemv(x, w, qtype, n_out, k_in, interpret=interpret)


def _gemm_rows_tc(x, w, qtype, n_out, k_in, *, interpret, precision, variant):
    """The tensor-core GEMV: 8-row groups, each in its own 16-row tile (a row gets the bits of the row alone)."""
    M = x.shape[0]
    G = -(-M // _gemv.M_MAX)
    cfg = _gemm.GEMV_TC
    base = jnp.arange(G, dtype=jnp.int32)[:, None] * _gemv.M_MAX
    rows = jnp.minimum(base + jnp.minimum(jnp.arange(cfg.BM, dtype=jnp.int32), _gemv.M_MAX - 1)[None], M - 1)
    y = _gemm.tile_gemm(x, w[None], jnp.zeros((G,), jnp.int32), rows, qtype, n_out, k_in, interpret=interpret,
                        precision=precision, cfg=cfg, variant=variant)                 # [G, 16, n_out]
    return y[:, :_gemv.M_MAX].reshape(G * _gemv.M_MAX, n_out)[:M]


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "k_in", "path", "gemm", "poison"))
def _qmatmul(x, w_raw, *, qtype, n_out, k_in, path, gemm, poison):
    if path == "reference":
        return _ref.qmatmul(x, w_raw, qtype, n_out, k_in)
    with dispatch.poison_outputs(poison):
        return _k.qmatmul_kernel(x, _as_float_weight(w_raw, qtype, k_in), qtype, n_out, k_in,
                                 interpret=path == "interpret", gemm=gemm)


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "k_in", "interpret", "poison"))
def _gemv_shared(x, ws, *, qtype, n_out, k_in, interpret, poison):
    ws = tuple(_as_float_weight(w, qtype, k_in) for w in ws)
    with dispatch.poison_outputs(poison):
        return _gemv.gemv(x, ws, qtype, n_out, k_in, interpret=interpret)


def qmatmul_shared(x, ws, qtype, n_out: int, k_in: int, *, impl: str = "auto", row_groups: bool = False,
                   precise: bool = False, prefill: bool = False) -> tuple:
    """``tuple(qmatmul(x, w, qtype, n_out, k_in, ...) for w in ws)``, bit for bit, for several weights of one format
    and shape that read the same activations (a gated MLP's gate and up): on the planar float32 GEMV (1..8 window
    rows, not ``prefill``, or row groups) the matrices share one launch and one read of ``x`` (`gemv.grouped_gemv`
    with a tuple of stacks: each output has the instructions of its own call); every other path makes the separate
    calls.

    Args: x float [M, k_in]; ws: a sequence of weights as `qmatmul` takes them, all of ``qtype`` and
    [n_out, ...]. Returns: a tuple of float32 [M, n_out]. Raises: as `qmatmul`.
    """
    ws = tuple(ws)
    qtype = blocks.check_supported(qtype)
    for w in ws:
        check_args(x, w, qtype, n_out, k_in, "quant_matmul.qmatmul_shared")
    gemv_rows = (x.shape[0] <= _gemv.M_MAX and not prefill) or row_groups
    if (len(ws) > 1 and gemv_rows and gemv_variant() == "fma" and shared_launch()
            and all(uses_planar_kernels(w, qtype, k_in) for w in ws)
            and len({(w.dtype, w.shape) for w in ws}) == 1):
        path = dispatch.resolve("quant_matmul.qmatmul", impl,
                                lambda: _gemv.why_not(qtype, n_out, k_in, ws[0].dtype))
        if path != "reference":
            return tuple(_gemv_shared(x, ws, qtype=qtype, n_out=n_out, k_in=k_in, interpret=path == "interpret",
                                      poison=dispatch.poisoning()))
    return tuple(qmatmul(x, w, qtype, n_out, k_in, impl=impl, row_groups=row_groups, precise=precise,
                         prefill=prefill) for w in ws)


def qmatmul(x, w_raw, qtype, n_out: int, k_in: int, *, impl: str = "auto", row_groups: bool = False,
            precise: bool = False, prefill: bool = False):
    """float32 [M, n_out] = x [M, k_in] @ dequantize(w_raw).T. See the module docstring for the full contract."""
    qtype = check_args(x, w_raw, qtype, n_out, k_in)
    if uses_planar_kernels(w_raw, qtype, k_in):
        path = dispatch.resolve("quant_matmul.qmatmul", impl,
                                lambda: _gemv.why_not(qtype, n_out, k_in, w_raw.dtype))
        gemm = (x.shape[0] > _gemv.M_MAX or prefill) and not row_groups
        return _qmatmul_planar(x, w_raw, qtype=qtype, n_out=n_out, k_in=k_in, path=path, gemm=gemm,
                               poison=dispatch.poisoning(), gemv=gemv_variant(), prec=precision(gemm, precise),
                               gemm_kernel=gemm_variant())
    path = dispatch.resolve(
        "quant_matmul.qmatmul", impl,
        lambda: _k.why_not(qtype, x.shape[0], n_out, k_in, x.dtype, getattr(w_raw, "dtype", jnp.uint8),
                           row_groups=row_groups))
    gemm = (x.shape[0] > _k.M_MAX or prefill) and not row_groups and _k.gemm_serves(qtype, n_out, k_in)
    return _qmatmul(x, w_raw, qtype=qtype, n_out=n_out, k_in=k_in, path=path, gemm=gemm,
                    poison=dispatch.poisoning())
