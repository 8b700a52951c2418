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

Planar weights (``STRATA_QMATMUL=planar``): the same union-slot scheme with the planar GEMV (`moe_experts_planar`;
gate and up of one format in one launch that shares the activation loads), and prefill chunks (any row count) sorted
by expert into row tiles with one grouped tensor-core GEMM per projection (`moe_prefill`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from strata_jax.pallas.grouped_experts.reference import swiglu, weighted_sum
from strata_jax.pallas.quant_matmul.kernel import M_MAX, grouped_qmatmul_kernel


def _gate_up(grouped, fused, x, gate, up, experts, qg, qu, n_ff, H, interpret):
    """gate and up of the union's experts: in one launch when ``fused`` (a grouped GEMV that reads several stacks
    at once: the planar one) and both are of one format and shape, else two."""
    if fused and qg == qu and gate.shape == up.shape and gate.dtype == up.dtype:
        return grouped(x, (gate, up), experts, qg, n_ff, H, interpret=interpret)
    return (grouped(x, gate, experts, qg, n_ff, H, interpret=interpret),
            grouped(x, up, experts, qu, n_ff, H, interpret=interpret))


def union_slots(topk_ids):
    """(experts [M*k] int32 ids of the union's slots (-1: idle), slot [M, k] int32 index of each pair's expert).

    Several rows: the sorted distinct ids padded with -1 (each expert read once for all rows). One row (a decode
    step): its own k ids in pair order, slot j for pair j -- no sort, scatter or search (5 launches per MoE layer
    on the GPU, the Flash-Next steps HLO of 2026-12-04); a row's top-k ids are distinct, and an id named twice
    would only be computed twice. A slot's values do not depend on its position in the union (each slot is its
    own programs of the grouped GEMV), so both forms give the same bits.
    """
    if topk_ids.shape[0] == 1:
        k = topk_ids.shape[1]
        return topk_ids.reshape(-1).astype(jnp.int32), jnp.arange(k, dtype=jnp.int32)[None]
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    experts = jnp.unique(flat, size=flat.shape[0], fill_value=-1)
    slot = jnp.argmax(experts[None, :] == flat[:, None], axis=1).astype(jnp.int32)
    return experts, slot.reshape(topk_ids.shape)


def moe_experts_kernel(x, topk_ids, topk_w, gate, up, down, qtypes, *, interpret: bool,
                       grouped=grouped_qmatmul_kernel, fused_gate_up: bool = False):
    """``grouped``: the grouped GEMV (`grouped_qmatmul_kernel` on GGUF bytes, or a planar one);
    ``fused_gate_up``: it takes a tuple of stacks (`strata_jax.pallas.quant_matmul.gemv.grouped_gemv`), so gate
    and up run in one launch."""
    M, H = x.shape
    if M > M_MAX:
        return _row_groups(x, topk_ids, topk_w, gate, up, down, qtypes, interpret=interpret, grouped=grouped,
                           fused_gate_up=fused_gate_up)
    n_ff = gate.shape[1]
    qg, qu, qd = qtypes
    experts, slot = union_slots(topk_ids)
    hg, hu = _gate_up(grouped, fused_gate_up, x, gate, up, experts, qg, qu, n_ff, H, interpret)  # [U, M, n_ff]
    act = swiglu(hg, hu)
    y = grouped(act, down, experts, qd, H, n_ff, interpret=interpret)  # [U, M, H]
    rows = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32)[:, None], slot.shape)
    return weighted_sum(y[slot, rows], topk_w)                                          # y[slot[m,j], m]


def _row_groups(x, topk_ids, topk_w, gate, up, down, qtypes, *, interpret: bool, grouped, fused_gate_up):
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
    hg, hu = _gate_up(grouped, fused_gate_up, xs, gate, up, experts, qg, qu, n_ff, H, interpret)  # [G*U, 8, n_ff]
    y = grouped(swiglu(hg, hu), down, experts, qd, H, n_ff, interpret=interpret)  # [G*U, 8, H]
    gslot = (slot + (jnp.arange(G, dtype=jnp.int32) * U)[:, None, None]).reshape(G * M_MAX, k)[:M]
    rows = jnp.broadcast_to((jnp.arange(M, dtype=jnp.int32) % M_MAX)[:, None], (M, k))
    return weighted_sum(y[gslot, rows], topk_w)                                          # y[slot, row in group]


# --- planar weights (STRATA_QMATMUL=planar; strata_jax.pallas.quant_matmul.planar) ---

def _grouped_gemv_tc(x, w_stacked, slot_expert, qtype, n_out, k_in, *, interpret, precision, variant=None):
    """`gemv.grouped_gemv`'s contract on the tensor cores: slot u's rows (x or x[u], M <= 8) in one 16-row tile."""
    from strata_jax.pallas.quant_matmul import gemm as G

    cfg = G.GEMV_TC
    U = slot_expert.shape[0]
    M = x.shape[-2]
    xs = x.reshape(-1, k_in)
    base = (jnp.arange(U, dtype=jnp.int32) * M)[:, None] if x.ndim == 3 else jnp.zeros((U, 1), jnp.int32)
    rows = base + jnp.minimum(jnp.arange(cfg.BM, dtype=jnp.int32), M - 1)[None]
    y = G.tile_gemm(xs, w_stacked, slot_expert, rows, qtype, n_out, k_in, interpret=interpret,
                    precision=precision, cfg=cfg, variant=variant)
    return y[:, :M]


def moe_experts_planar(x, topk_ids, topk_w, gate, up, down, qtypes, *, interpret: bool, prefill: bool,
                       gemv: str, precision: str, gemm_kernel: str | None = None):
    """The routed experts on planar weights: windows as `moe_experts_kernel` with the planar GEMV (``gemv``: ``fma``
    or ``tc``; ``tc16``, the dense tensor-core GEMV, has no grouped form yet and runs ``fma`` here); prefill chunks
    (any row count) as `moe_prefill`. ``gemm_kernel``: `gemm.tile_gemm`'s
    ``variant`` (None: ``STRATA_QMATMUL_GEMM``)."""
    from strata_jax.pallas.quant_matmul import gemv as V

    if prefill:   # any row count: a row's bits never depend on the chunk's (dense qmatmul's ``prefill`` too)
        return moe_prefill(x, topk_ids, topk_w, gate, up, down, qtypes, interpret=interpret, precision=precision,
                           variant=gemm_kernel)
    if gemv == "tc":
        from strata_jax.pallas.quant_matmul import gemm as G
        fn = functools.partial(_grouped_gemv_tc, precision=G.gemv_precision(precision), variant=gemm_kernel)
    else:  # the K split sized for one row's k experts at every row count (`gemv.grouped_gemv`'s split_units)
        fn = functools.partial(V.grouped_gemv, split_units=topk_ids.shape[1])
    return moe_experts_kernel(x, topk_ids, topk_w, gate, up, down, qtypes, interpret=interpret, grouped=fn,
                              fused_gate_up=gemv != "tc")


def expert_tiles(topk_ids, n_experts: int, BM: int):
    """Sort a chunk's (row, slot) pairs by expert into row tiles of one expert each (no atomics: a stable sort and
    integer counts, so the layout is a function of the ids alone).

    Returns (tile_expert int32 [T] (-1: idle), tile_rows int32 [T, BM] (row of x; padding 0), pair_tile /
    pair_pos int32 [M, k]: where each pair's result lands), with the static bound
    T = (P + min(E, P) * (BM - 1)) // BM tiles for P = M * k pairs.
    """
    M, k = topk_ids.shape
    P = M * k
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    counts = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
    seg_start = jnp.cumsum(counts) - counts
    n_tiles_e = (counts + BM - 1) // BM
    tile_start = jnp.cumsum(n_tiles_e) - n_tiles_e
    T = (P + min(n_experts, P) * (BM - 1)) // BM
    rank = jnp.arange(P, dtype=jnp.int32) - seg_start[sorted_e]
    tile = tile_start[sorted_e] + rank // BM
    pos = rank % BM
    tile_expert = jnp.full((T,), -1, jnp.int32).at[tile].set(sorted_e)
    tile_rows = jnp.zeros((T, BM), jnp.int32).at[tile, pos].set((order // k).astype(jnp.int32))
    pair_tile = jnp.zeros((P,), jnp.int32).at[order].set(tile).reshape(M, k)
    pair_pos = jnp.zeros((P,), jnp.int32).at[order].set(pos).reshape(M, k)
    return tile_expert, tile_rows, pair_tile, pair_pos


def moe_prefill(x, topk_ids, topk_w, gate, up, down, qtypes, *, interpret: bool, precision: str,
                variant: str | None = None, cfg=None):
    """MoE prefill: the chunk's (row, expert) pairs grouped by expert (`expert_tiles`), one grouped tensor-core
    GEMM per projection (`strata_jax.pallas.quant_matmul.gemm.tile_gemm`: each tile reads its expert's weights
    once), SwiGLU between, then each row's k results summed in slot order. Row-independent: a pair's result does
    not depend on the other pairs of its tile or chunk. ``variant``: `tile_gemm`'s kernel (None: the environment);
    ``cfg``: its launch parameters (None: `gemm.moe_prefill_config` for the chunk, `gemm.MOE_PREFILL` on the unit
    kernel; benchmarks try others)."""
    from strata_jax.pallas.quant_matmul import gemm as G

    M, H = x.shape
    E, n_ff = gate.shape[:2]
    qg, qu, qd = qtypes
    variant = G.gemm_variant() if variant is None else variant
    if cfg is None:   # row sub-tiles are the K-block kernel's
        cfg = (G.moe_prefill_config(M, topk_ids.shape[1], E, f16=precision == G.F16) if variant == "kblock"
               else G.MOE_PREFILL)
    TM = cfg.tile_m
    tile_expert, tile_rows, pair_tile, pair_pos = expert_tiles(topk_ids, E, TM)
    T = tile_expert.shape[0]
    kw = dict(interpret=interpret, precision=precision, cfg=cfg, variant=variant)
    hg = G.tile_gemm(x, gate, tile_expert, tile_rows, qg, n_ff, H, **kw)                # [T, TM, n_ff]
    hu = G.tile_gemm(x, up, tile_expert, tile_rows, qu, n_ff, H, **kw)
    act = swiglu(hg, hu).reshape(T * TM, n_ff)
    rows2 = jnp.arange(T * TM, dtype=jnp.int32).reshape(T, TM)
    y = G.tile_gemm(act, down, tile_expert, rows2, qd, H, n_ff, **kw)                   # [T, TM, H]
    return weighted_sum(y[pair_tile, pair_pos], topk_w)
