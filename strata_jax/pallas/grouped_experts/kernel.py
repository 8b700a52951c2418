"""Pallas path of the routed-expert block: each selected expert's weights are read once per window.

The window's (row, slot) pairs select at most M*k distinct experts. The wrapper lists that union (sorted, padded
with -1) and runs the grouped quantized GEMV of `strata_jax.pallas.quant_matmul.kernel` three times: gate and up
for all M rows against every expert of the union (grid: output tiles x K splits x union slots; each program reads
one tile of one expert once), the SwiGLU in jnp, then down with each union slot's own activations. Finally every
pair (m, j) picks its expert's row m and the rows are summed in slot order, as in the reference.

Rows never mix: the GEMV computes each activation row with the same instructions whatever M is and whichever
other rows chose the expert (a row that did not choose it is computed too, and then ignored).

More than 8 rows (windows of several segments, prefill chunks): the rows are cut into groups of 8 (the last one
padded with copies of its last row, which add no expert), each group has its own union, and all groups' union
slots run in the same three launches, each slot with its own group's rows (`grouped_qmatmul_kernel` with
per-slot activations). Each expert of a group's union is read once per group; a row gets the same instructions as
in an 8-row call.
"""

from __future__ import annotations

import jax.numpy as jnp

import jax

from strata_jax.pallas.grouped_experts.reference import swiglu, weighted_sum
from strata_jax.pallas.quant_matmul.kernel import M_MAX, grouped_qmatmul_kernel


def union_slots(topk_ids):
    """(experts [M*k] int32 sorted distinct ids padded with -1, slot [M, k] int32 index of each pair's expert)."""
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    experts = jnp.unique(flat, size=flat.shape[0], fill_value=-1)
    slot = jnp.argmax(experts[None, :] == flat[:, None], axis=1).astype(jnp.int32)
    return experts, slot.reshape(topk_ids.shape)


def moe_experts_kernel(x, topk_ids, topk_w, gate, up, down, qtypes, *, interpret: bool):
    M, H = x.shape
    if M > M_MAX:
        return _row_groups(x, topk_ids, topk_w, gate, up, down, qtypes, interpret=interpret)
    n_ff = gate.shape[1]
    qg, qu, qd = qtypes
    experts, slot = union_slots(topk_ids)
    hg = grouped_qmatmul_kernel(x, gate, experts, qg, n_ff, H, interpret=interpret)   # [U, M, n_ff]
    hu = grouped_qmatmul_kernel(x, up, experts, qu, n_ff, H, interpret=interpret)
    act = swiglu(hg, hu)
    y = grouped_qmatmul_kernel(act, down, experts, qd, H, n_ff, interpret=interpret)  # [U, M, H]
    rows = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32)[:, None], slot.shape)
    return weighted_sum(y[slot, rows], topk_w)                                          # y[slot[m,j], m]


def _row_groups(x, topk_ids, topk_w, gate, up, down, qtypes, *, interpret: bool):
    """M > 8 rows: groups of 8 rows, each with its own union, in one launch per matrix (module docstring)."""
    M, H = x.shape
    k = topk_ids.shape[1]
    n_ff = gate.shape[1]
    qg, qu, qd = qtypes
    G = -(-M // M_MAX)
    pad = [(0, G * M_MAX - M), (0, 0)]
    xg = jnp.pad(x, pad, mode="edge").reshape(G, M_MAX, H)
    idg = jnp.pad(topk_ids, pad, mode="edge").reshape(G, M_MAX, k)
    experts, slot = jax.vmap(union_slots)(idg)                                           # [G, 8k], [G, 8, k]
    U = M_MAX * k                                                                        # slots per group
    experts = experts.reshape(G * U)
    xs = jnp.repeat(xg, U, axis=0)                                                       # [G*U, 8, H]
    hg = grouped_qmatmul_kernel(xs, gate, experts, qg, n_ff, H, interpret=interpret)      # [G*U, 8, n_ff]
    hu = grouped_qmatmul_kernel(xs, up, experts, qu, n_ff, H, interpret=interpret)
    y = grouped_qmatmul_kernel(swiglu(hg, hu), down, experts, qd, H, n_ff, interpret=interpret)  # [G*U, 8, H]
    gslot = (slot + (jnp.arange(G, dtype=jnp.int32) * U)[:, None, None]).reshape(G * M_MAX, k)[:M]
    rows = jnp.broadcast_to((jnp.arange(M, dtype=jnp.int32) % M_MAX)[:, None], (M, k))
    return weighted_sum(y[gslot, rows], topk_w)                                          # y[slot, row in group]
