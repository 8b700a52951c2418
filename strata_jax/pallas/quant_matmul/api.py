"""Public API: `qmatmul`, a matmul of activations by a GGUF block-quantized weight matrix.

Source: GGUF block layouts from ggml (``ggml/src/ggml-common.h`` structs, ``dequantize_row_*`` in
``ggml/src/ggml-quants.c``); the formats the shipped GGUF models use.

``qmatmul(x, w_raw, qtype, n_out, k_in, *, impl="auto", row_groups=False) -> float32 [M, n_out]``

* ``x``: [M, k_in] float32 / bfloat16 / float16 activations (M = verify-window rows, or prefill tokens).
* ``w_raw``: the GGUF matrix of logical shape [n_out, k_in] (numpy order; ggml ``ne`` = [k_in, n_out]) as stored:
  uint8 [n_out, row_bytes] for a block format (``row_bytes = k_in / values_per_block * bytes_per_block``), or
  float32 / float16 / bfloat16 [n_out, k_in] (or their raw bytes) for F32 / F16 / BF16.
* ``qtype``: `gguf.GGMLQuantizationType` (or its int id); ``n_out``, ``k_in``: Python ints.
* Result: ``y[m, n] = sum_k x[m, k] * W[n, k]`` with W the dequantized weight, accumulated in float32.
* ``row_groups``: let the kernel serve M > 8 rows as groups of 8 rows of the GEMV in one launch (the weight is read
  once per group): every row then gets the GEMV's bits whatever M is. For verify windows of several segments
  (B * T > 8 rows), which must give each row the bits of the row alone. Without it (prefill chunks), M > 8 rows
  take the kernel's 16-row GEMM (the same bits for a row whatever M is, but not the GEMV's).

Paths (``impl``, see `strata_jax.pallas.dispatch`): the reference dequantizes with `strata_jax.gguf.blocks` and
multiplies in fixed 8-row chunks at HIGHEST precision; the kernel (formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, F32, F16, BF16; any M: the GEMV for 1..8 rows and for 8-row groups, the GEMM for prefill)
decodes in registers and reads each weight byte once per row group. The two are not bit-identical (different
summation order); each is row-independent (row m of an M-row call == the row alone, bit for bit: the kernel's
GEMV for M <= 8 and with row groups for any M, its GEMM among GEMM calls of any M, the reference for any M) and
within ~1e-5 relative of a float64 product.

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
from strata_jax.pallas.quant_matmul import kernel as _k
from strata_jax.pallas.quant_matmul import reference as _ref
from strata_jax.pallas.quant_matmul.formats import FLOAT_TYPES

KERNEL_FORMATS = frozenset(_k.FORMATS) | frozenset(FLOAT_TYPES)


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
    if qtype in FLOAT_TYPES and w_raw.dtype != jnp.uint8:
        if w_raw.shape[1] != k_in:
            raise UnsupportedError(f"{op}: {qtype.name} weight has shape {w_raw.shape}, expected [{n_out}, {k_in}]")
    else:
        rb = blocks.row_bytes(qtype, k_in)
        if w_raw.dtype != jnp.uint8 or w_raw.shape[1] != rb:
            raise UnsupportedError(f"{op}: {qtype.name} weight must be uint8 [{n_out}, {rb}], "
                                   f"got {w_raw.dtype} {w_raw.shape}")
    return qtype


@functools.partial(jax.jit, static_argnames=("qtype", "n_out", "k_in", "path", "gemm", "poison"))
def _qmatmul(x, w_raw, *, qtype, n_out, k_in, path, gemm, poison):
    if path == "reference":
        return _ref.qmatmul(x, w_raw, qtype, n_out, k_in)
    with dispatch.poison_outputs(poison):
        return _k.qmatmul_kernel(x, _as_float_weight(w_raw, qtype, k_in), qtype, n_out, k_in,
                                 interpret=path == "interpret", gemm=gemm)


def qmatmul(x, w_raw, qtype, n_out: int, k_in: int, *, impl: str = "auto", row_groups: bool = False):
    """float32 [M, n_out] = x [M, k_in] @ dequantize(w_raw).T. See the module docstring for the full contract."""
    qtype = check_args(x, w_raw, qtype, n_out, k_in)
    path = dispatch.resolve(
        "quant_matmul.qmatmul", impl,
        lambda: _k.why_not(qtype, x.shape[0], n_out, k_in, x.dtype, getattr(w_raw, "dtype", jnp.uint8),
                           row_groups=row_groups))
    gemm = x.shape[0] > _k.M_MAX and not row_groups and _k.gemm_serves(qtype, n_out, k_in)
    return _qmatmul(x, w_raw, qtype=qtype, n_out=n_out, k_in=k_in, path=path, gemm=gemm,
                    poison=dispatch.poisoning())
