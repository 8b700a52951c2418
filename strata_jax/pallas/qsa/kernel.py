"""Pallas kernel for the attention part of QSA: each (row, kv head, split) program streams its share of the
row's selected cells (gathered K/V rows of the cache) with an online softmax, for all query heads of the group.

Grid: (T rows, Hkv kv heads, NSPLIT splits of the cell list). A program keeps the running max m, sum l and
accumulator acc [Gp, D] of its Gp (= the group's query heads, padded to a power of two >= 16) heads; the wrapper
merges the splits in a fixed order: ``M = max_s m_s, o = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s``, the
sums a pairwise tree over the splits (`strata_jax.layers.exact.pairwise_sum`).
Scores and P.V are float32 dots: TF32x3 on tensor cores when compiled (about fp32 accuracy), plain fp32 in
interpret mode. Rows never mix, and the split layout (the split size and count, and each program's loop of a
compile-time trip count over its share; the list is padded with -1 to fill every split) depends on the cell-list
length only, so row t of a T-row call equals the row alone: the fixed-split-size rule of split-KV attention.

The cell list comes from the indexer (`block_scores_kernel` scores every block of a row in its own programs;
top-k block selection and the tail in jnp, `reference.select_blocks` / `selected_cells`), or for dense attention
from the causal (and sliding-window) mask (`strata_jax.layers.attention`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from strata_jax.layers import exact
from strata_jax.pallas import dispatch
from strata_jax.pallas.qsa.reference import NEG

NC = 16        # cells per loop step (K and V tiles of [NC, D] float32 stay in registers)
MAX_SPLIT = 32 # programs per (row, kv head)


@dataclasses.dataclass(frozen=True)
class AttendConfig:
    """Launch parameters of `attend_kernel` (functions of the head shape and the cell-list length only, never of
    the rows: a row's split layout is fixed by them). ``tag`` is appended to the kernel's name (sweeps)."""
    NC: int = NC
    max_split: int = MAX_SPLIT
    num_warps: int = 4
    num_stages: int = 2
    DC: int = 0          # head-dim slice of the products (0: the whole D)
    tag: str = ""


def choose_attend_config(D: int, n_cells: int) -> AttendConfig:
    """The launch parameters for a head dim and cell-list length, from `experiments/sweep_kernels.py` on the H200
    (2026-12-03, one row, device time, 16 configs; results/h200_2026-12-03b): D <= 128 (Qwen2.5-1.5B, 12 / 2
    heads): 16-cell steps, up to 128 splits, 4 warps at lists up to 2,048 cells (3.4-3.6 us at 1,025, was 8.7),
    32-cell steps and 8 warps above (7.4-7.7 us at 4,097, was 23.2); D = 256 (Flash-Next QSA, 24 / 2 heads,
    2,051 listed cells): 32-cell steps, 128 splits, 8 warps, 7.6-8.0 us (122 us per call in the step profile
    before q was read per step instead of held in registers). A function of D and the list length only."""
    if D <= 128 and n_cells <= 2048:
        return AttendConfig(NC=16, max_split=128, num_warps=4, num_stages=2)
    return AttendConfig(NC=32, max_split=128, num_warps=8, num_stages=2)


def why_not(Hq: int, Hkv: int, D: int, n_cells: int, dtypes) -> str | None:
    if Hkv <= 0 or Hq % Hkv:
        return f"Hq={Hq} is not a multiple of Hkv={Hkv}"
    if not dispatch.is_pow2(D) or D < 16:
        return f"head dim {D} is not a power of two >= 16"
    if n_cells * Hkv * D >= 2**31:
        return "KV cache too large for int32 offsets"
    for dt in dtypes:
        if jnp.dtype(dt) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"dtype {jnp.dtype(dt).name}"
    return None


def _kernel(cells_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *, Hkv, G, D, Gp, C, cps, n_chunks, scale,
            interpret, NC, DC):
    HP = dispatch.f32_dot_precision(interpret)
    t = pl.program_id(0)
    g = pl.program_id(1)
    sp = pl.program_id(2)
    nd = D // DC
    # the group's G query heads read in place from the flat q [T * Hkv * G * D]; the Gp - G padding rows of the
    # tile repeat the last head (their outputs are dropped by the wrapper)
    head = jnp.minimum(lax.broadcasted_iota(jnp.int32, (Gp, 1), 0), G - 1)
    dcol = lax.broadcasted_iota(jnp.int32, (1, DC), 1)
    qoff = ((t * Hkv + g) * G + head) * D + dcol                                 # [Gp, DC]
    lane = lax.broadcasted_iota(jnp.int32, (NC,), 0)

    def body(j, carry):
        c = sp * cps + j
        cell = cells_ref[t * C + c * NC + lane]                                  # [NC]

        def attend(carry):
            m, l, acc = carry
            ok = cell >= 0
            off = (jnp.maximum(cell, 0)[:, None] * Hkv + g) * D + dcol           # [NC, DC]
            # D in nd slices of DC (fixed order): a slice's q / K / V tiles at a time stay in registers for D = 256
            s = None
            for d in range(nd):
                sd = lax.dot_general(q_ref[qoff + d * DC].astype(jnp.float32), k_ref[off + d * DC].astype(jnp.float32),
                                     (((1,), (1,)), ((), ())), precision=HP, preferred_element_type=jnp.float32)
                s = sd if s is None else s + sd                                  # [Gp, NC]
            s = jnp.where(ok[None, :], s * scale, NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
            acc = tuple(a * alpha[:, None] + lax.dot_general(p, v_ref[off + d * DC].astype(jnp.float32),
                                                             (((1,), (0,)), ((), ())), precision=HP,
                                                             preferred_element_type=jnp.float32)
                        for d, a in enumerate(acc))
            return m_new, l * alpha + jnp.sum(p, axis=1), acc

        # A step of only -1 cells would leave (m, l, acc) as they are (alpha = 1, p = 0): skip its loads and dots.
        # Dense attention lists a slot's cells in order with -1 past the causal limit, so a row's work follows its
        # position, not the cache length; the result is the same bits either way.
        return lax.cond(jnp.max(cell) >= 0, attend, lambda c_: c_, carry)

    init = (jnp.full((Gp,), NEG, jnp.float32), jnp.zeros((Gp,), jnp.float32),
            tuple(jnp.zeros((Gp, DC), jnp.float32) for _ in range(nd)))
    m, l, acc = lax.fori_loop(0, cps, body, init)
    m_ref[t, g, sp, :] = m
    l_ref[t, g, sp, :] = l
    for d, a in enumerate(acc):
        acc_ref[t, g, sp, :, pl.ds(d * DC, DC)] = a


def attend_kernel(q, k_cache, v_cache, cells, scale, *, interpret: bool, cfg: AttendConfig | None = None):
    """Same contract as `reference.attend`. Not jitted. ``cfg``: launch parameters (default
    `choose_attend_config`)."""
    T, Hq, D = q.shape
    N, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    Gp = max(16, pl.next_power_of_2(G))
    cfg = cfg or choose_attend_config(D, cells.shape[1])
    nc = cfg.NC
    n_chunks = -(-cells.shape[1] // nc)
    nsplit = min(cfg.max_split, n_chunks)
    cps = -(-n_chunks // nsplit)
    nsplit = -(-n_chunks // cps)
    n_chunks = nsplit * cps  # every split runs cps chunks (the list padded with -1)
    C = n_chunks * nc
    cells = cells.astype(jnp.int32)
    if C != cells.shape[1]:
        cells = jnp.pad(cells, [(0, 0), (0, C - cells.shape[1])], constant_values=-1)
    full = pl.no_block_spec
    call = dispatch.pallas_call(
        functools.partial(_kernel, Hkv=Hkv, G=G, D=D, Gp=Gp, C=C, cps=cps, n_chunks=n_chunks, scale=float(scale),
                          interpret=interpret, NC=nc, DC=min(cfg.DC or D, D)),
        out_shape=[jax.ShapeDtypeStruct((T, Hkv, nsplit, Gp), jnp.float32),
                   jax.ShapeDtypeStruct((T, Hkv, nsplit, Gp), jnp.float32),
                   jax.ShapeDtypeStruct((T, Hkv, nsplit, Gp, D), jnp.float32)],
        grid=(T, Hkv, nsplit), in_specs=[full] * 4, out_specs=[full] * 3, interpret=interpret,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, name="qsa_attend" + cfg.tag)
    m, l, acc = call(cells.reshape(-1), q.reshape(-1), k_cache.reshape(-1), v_cache.reshape(-1))
    m, l, acc = m[..., :G], l[..., :G], acc[:, :, :, :G]                      # the G real heads
    # The splits merged by a fixed pairwise tree over the split axis (its order a function of the split count
    # only): a serial chain of 65 splits was one XLA fusion of 5.5 us per call on the H200 (2026-12-04: the
    # 1.5B step's largest glue kernel), latency-bound; the tree has depth 7. acc and l each take their own tree
    # (the same adds per element as one tree over l joined to acc, which cost a copy of acc as large as the
    # attention: 4.1 ms per 16-layer Flash-Next prefill chunk on the H100, 2026-12-06).
    w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))                           # [T, Hkv, S, G]
    A = exact.pairwise_sum(acc * w[..., None], axis=2)[:, :, 0]                  # [T, Hkv, G, D]
    L = exact.pairwise_sum(l * w, axis=2)[:, :, 0]                               # [T, Hkv, G]
    return (A / L[..., None]).reshape(T, Hq, D)


def _scores_kernel(seg_ref, q_ref, p_ref, o_ref, *, NB, NBT, Di, interpret):
    t = pl.program_id(0)
    j = pl.program_id(1)
    HP = dispatch.f32_dot_precision(interpret)
    qv = q_ref[t, :, :].astype(jnp.float32)                                     # [Hp, Di]
    blk = j * NBT + lax.broadcasted_iota(jnp.int32, (NBT, 1), 0)
    off = (seg_ref[t] * NB + jnp.minimum(blk, NB - 1)) * Di + lax.broadcasted_iota(jnp.int32, (1, Di), 1)
    pk = p_ref[off].astype(jnp.float32)                                          # [NBT, Di]
    s = lax.dot_general(qv, pk, (((1,), (1,)), ((), ())), precision=HP, preferred_element_type=jnp.float32)
    o_ref[t, pl.ds(j * NBT, NBT)] = jnp.sum(jnp.maximum(s, 0.0), axis=0)       # padded heads add ReLU(0) = 0


def scores_why_not(Hi: int, Di: int, NB: int) -> str | None:
    if not dispatch.is_pow2(Di) or Di < 16:
        return f"indexer head dim {Di} is not a power of two >= 16"
    return None


def block_scores_kernel(iq, pooled, seg, *, interpret: bool):
    """Same contract as `reference.block_scores` (``seg`` may be None): float32 [T, NB]. One program per (row,
    tile of blocks): a [Hp, Di] x [Di, NBT] product, ReLU, and the sum over the heads (padded to Hp >= 16 with
    zeros). Not jitted."""
    T, Hi, Di = iq.shape
    if seg is None:
        pooled, seg = pooled[None], jnp.zeros((T,), jnp.int32)
    NB = pooled.shape[1]
    Hp = max(16, pl.next_power_of_2(Hi))
    NBT = min(128, max(16, pl.next_power_of_2(NB)))
    n_bt = -(-NB // NBT)
    rows = max(T, 2) if interpret else T  # interpret mode: never a grid of one program (see the GEMV's note)
    qp = jnp.pad(iq.astype(jnp.float32), [(0, rows - T), (0, Hp - Hi), (0, 0)])
    segp = jnp.pad(seg.astype(jnp.int32), (0, rows - T))
    full = pl.no_block_spec
    call = dispatch.pallas_call(
        functools.partial(_scores_kernel, NB=NB, NBT=NBT, Di=Di, interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct((rows, n_bt * NBT), jnp.float32)], grid=(rows, n_bt),
        in_specs=[full] * 3, out_specs=[full], interpret=interpret, num_warps=4, num_stages=1, name="qsa_scores")
    (sc,) = call(segp, qp, pooled.astype(jnp.float32).reshape(-1))
    return sc[:T, :NB]
