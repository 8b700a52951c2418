"""Plain-jnp reference of the routed-expert SwiGLU block, one (row, expert) pair at a time.

For each row m and each of its k selected experts e = topk_ids[m, j]:
    y_mj = down_e( silu(gate_e x_m) * up_e x_m )
and out_m = sum_j topk_w[m, j] * y_mj, summed in slot order j = 0, 1, ..., k-1.
Each matvec is `strata_jax.pallas.quant_matmul.matmul_rows` on the single row (the row-chunked qmatmul semantics),
inside a loop over the pairs whose trip count XLA cannot see, over at least two pairs, so every pair runs the same
compiled body whatever M is (see quant_matmul/reference.py for why).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from strata_jax.pallas.quant_matmul.reference import dequantize_weight, matmul_rows


def swiglu(g, u):
    """silu(g) * u, float32 (HF ``act_fn(gate_proj(x)) * up_proj(x)`` with act_fn = silu)."""
    return jax.nn.silu(g) * u


def weighted_sum(y, topk_w):
    """sum_j topk_w[:, j] * y[:, j] in the fixed order j = 0..k-1. y [M, k, H] f32, topk_w [M, k] -> [M, H]."""
    w = topk_w.astype(jnp.float32)
    out = w[:, 0, None] * y[:, 0]
    for j in range(1, y.shape[1]):
        out = out + w[:, j, None] * y[:, j]
    return out


def moe_experts(x, topk_ids, topk_w, gate, up, down, qtypes):
    M, H = x.shape
    k = topk_ids.shape[1]
    n_ff = gate.shape[1]
    qg, qu, qd = qtypes
    P = M * k
    Pp = max(P, 2)
    pair_e = jnp.pad(topk_ids.reshape(-1).astype(jnp.int32), (0, Pp - P))
    pair_row = jnp.pad(jnp.arange(P, dtype=jnp.int32) // k, (0, Pp - P))
    xf = x.astype(jnp.float32)

    def body(p, y):
        e = pair_e[p]
        xr = lax.dynamic_index_in_dim(xf, pair_row[p], axis=0, keepdims=True)  # [1, H]
        g = matmul_rows(xr, dequantize_weight(gate[e], qg, H))
        u = matmul_rows(xr, dequantize_weight(up[e], qu, H))
        d = matmul_rows(swiglu(g, u), dequantize_weight(down[e], qd, n_ff))   # [1, H]
        return lax.dynamic_update_index_in_dim(y, d, p, axis=0)

    y = lax.fori_loop(0, lax.optimization_barrier(jnp.int32(P)), body, jnp.zeros((Pp, H), jnp.float32))
    return weighted_sum(y[:P].reshape(M, k, H), topk_w)
