"""Plain-jnp reference of the quantized matmul: ``x @ dequantize(w).T`` in float32, in fixed 8-row chunks.

Source: the GGUF block layouts of ggml (``ggml-common.h`` / ``ggml-quants.c``), decoded by
`strata_jax.gguf.blocks.dequantize` (bit-identical to gguf-py's ``gguf.quants.dequantize``).

Row independence: XLA picks different dot algorithms (and so different summation orders) for 1 row and for
several, so the reference pads M up to a multiple of 8 and loops one fixed [8, K] x [K, n_out] product over the
chunks. The loop's trip count is hidden from XLA (`lax.optimization_barrier`), so even a single chunk runs inside
the loop, and the padded activations always hold at least two chunks, so XLA can neither drop the loop nor hoist
the dot out of it (seen on XLA CPU: a hoisted dot reads the weight in another layout and rounds differently).
Every row then goes through the same dot, whatever M is and whatever the other rows hold.
The product runs at ``Precision.HIGHEST`` (no TF32 on GPU).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from strata_jax.gguf import blocks

ROW_CHUNK = 8


def dequantize_weight(w_raw, qtype, k_in: int):
    """float32 [..., k_in] from a GGUF matrix (uint8 [..., row_bytes], or F32/F16/BF16 [..., k_in]) or a planar one
    (uint32 [..., row_words], `strata_jax.pallas.quant_matmul.planar`: the same values)."""
    from strata_jax.pallas.quant_matmul import planar
    if planar.is_planar(w_raw, qtype):
        return planar.dequantize(w_raw, qtype=blocks.check_supported(qtype), n_cols=k_in)
    return blocks.dequantize(w_raw, qtype, k_in)


def matmul_rows(x, w):
    """x [M, K] (any float dtype) @ w[n_out, K].T in float32, by fixed 8-row chunks -> float32 [M, n_out]."""
    M, K = x.shape
    n_chunks = -(-M // ROW_CHUNK)
    Mp = max(n_chunks, 2) * ROW_CHUNK
    xp = jnp.pad(x.astype(jnp.float32), [(0, Mp - M), (0, 0)]).reshape(Mp // ROW_CHUNK, ROW_CHUNK, K)
    w = w.astype(jnp.float32)
    y0 = jnp.zeros((Mp // ROW_CHUNK, ROW_CHUNK, w.shape[0]), jnp.float32)

    def body(c, y):
        xc = lax.dynamic_index_in_dim(xp, c, axis=0, keepdims=False)
        yc = lax.dot_general(xc, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)
        return lax.dynamic_update_index_in_dim(y, yc, c, axis=0)

    y = lax.fori_loop(0, lax.optimization_barrier(jnp.int32(n_chunks)), body, y0)
    return y.reshape(Mp, -1)[:M]


def qmatmul(x, w_raw, qtype, n_out: int, k_in: int):
    """Reference of `strata_jax.pallas.quant_matmul.qmatmul` (same arguments) -> float32 [M, n_out]."""
    return matmul_rows(x, dequantize_weight(w_raw, qtype, k_in))
