"""Pallas path of the routed-expert block: each selected expert's weights are read once per window.

The window's (row, slot) pairs select at most M*k distinct experts. The wrapper lists that union (sorted, padded
with -1) and runs the grouped quantized GEMV of `strata_jax.pallas.quant_matmul.kernel` three times: gate and up
for all M rows against every expert of the union (grid: output tiles x K splits x union slots; each program reads
one tile of one expert once), the SwiGLU in jnp, then down with each union slot's own activations. Finally every
pair (m, j) picks its expert's row m and the rows are summed in slot order, as in the reference.

Rows never mix: the GEMV computes each activation row with the same instructions whatever M is and whichever
other rows chose the expert (a row that did not choose it is computed too, and then ignored).
"""

from __future__ import annotations

import jax.numpy as jnp

from strata_jax.pallas.grouped_experts.reference import swiglu, weighted_sum
from strata_jax.pallas.quant_matmul.kernel import grouped_qmatmul_kernel


def union_slots(topk_ids):
    """(experts [M*k] int32 sorted distinct ids padded with -1, slot [M, k] int32 index of each pair's expert)."""
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    experts = jnp.unique(flat, size=flat.shape[0], fill_value=-1)
    slot = jnp.argmax(experts[None, :] == flat[:, None], axis=1).astype(jnp.int32)
    return experts, slot.reshape(topk_ids.shape)


def moe_experts_kernel(x, topk_ids, topk_w, gate, up, down, qtypes, *, interpret: bool):
    M, H = x.shape
    n_ff = gate.shape[1]
    qg, qu, qd = qtypes
    experts, slot = union_slots(topk_ids)
    hg = grouped_qmatmul_kernel(x, gate, experts, qg, n_ff, H, interpret=interpret)   # [U, M, n_ff]
    hu = grouped_qmatmul_kernel(x, up, experts, qu, n_ff, H, interpret=interpret)
    act = swiglu(hg, hu)
    y = grouped_qmatmul_kernel(act, down, experts, qd, H, n_ff, interpret=interpret)  # [U, M, H]
    rows = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32)[:, None], slot.shape)
    return weighted_sum(y[slot, rows], topk_w)                                          # y[slot[m,j], m]
