"""Pallas tensor-core matmul on planar (`planar`) and F16 / BF16 / F32 weights, over tiles of activation rows:
the prefill GEMM, the grouped-expert GEMM of MoE prefill, and a tensor-core variant of the 1..8-row GEMV.

Source: block formats of ggml via `strata_jax.pallas.quant_matmul.decode`; the split products are the bfloat16
piece schemes of XLA's dot algorithms (``BF16_BF16_F32``, ``BF16_BF16_F32_X3``, ``BF16_BF16_F32_X6``).

Two kernels compute the same ``[BN weight rows, BM activation rows]`` tiles (``STRATA_QMATMUL_GEMM``, `gemm_variant`):

* ``kblock`` (the default; `_kernel_kblock`): per loop step a block of ``KB`` values of K (a multiple of the
  32-value group, `Config.KB`). The step decodes the BN rows' codes (`gemv.decode_tile`) and forms the float32
  weights ``w = dl * code + mn`` exactly as `planar.dequantize` does; it cuts w and the activations into bfloat16
  pieces (`bf16_pieces`; the activations once, outside the kernel) and runs the products of `piece_products` as
  ``[BN, KB] x [KB, BM]`` tensor-core dots accumulated in float32, with no per-unit epilogue. `PRECISIONS` gives
  the pieces per operand: ``bf16`` 1 (one product, ~3e-3 relative), ``bf16x2`` 2 (XLA's X3: 3 products, ~1e-6),
  ``bf16x3`` 3 (XLA's X6: 6 products, float32-like); an operand exact in fewer pieces gets fewer (BF16 weights 1,
  F16 2; bfloat16 activations 1, float16 2).
* ``unit`` (`_kernel_unit`, the kernel before 2026-12-05): per scale unit of 16 / 32 values it multiplies the
  integer codes, exact in bfloat16 (|code| <= 256), against the unit's activations cut into `PRECISIONS` pieces
  (``bf16`` x0 only, ~3e-3; ``bf16x2`` x0 + x1, ~1e-5; ``bf16x3`` all three, float32 accuracy), then ``acc += dl
  * P + mn * sum x`` once per unit. F16 / F32 weights are cut into 2 / 3 pieces (pairs of pieces whose order sum
  is at least the piece count are dropped). On the H200 it is bound by its K = 16 / 32 dots and the [BN, BM]
  float32 epilogue per unit (Q4_K 8960 x 1536 at 512 rows, bf16x3: 341 us, ~40 TFLOP/s; 2026-12-04).

Neither materialises the weight in memory: codes go from registers to the tensor cores.

Precision (`GEMM_PRECISIONS`): the prefill default is `F16` (`DEFAULT_PRECISION`; kblock only): the weights and
each activation row, scaled by a power of two per row, rounded to float16 once, one float16 product per step,
float32 accumulation (~1e-4 of ``|x| @ |W|``); `PRECISE_PRECISION` (bf16x2) for the GEMMs whose error a recurrence
amplifies (`strata_jax.layers.linear.QLinear.precise`), for BF16 / F32 weights and for the unit kernel. The tiles
(`KBLOCK_PREFILL`, `MOE_PREFILL`) were tuned at bf16x2 and re-swept at f16 (2026-12-07e: `kblock_config`,
`moe_prefill_config`).

Row tiles: ``tile_rows`` [T, BM] lists which activation rows each tile reads (padding repeats a valid row; its
output is ignored) and ``tile_expert`` [T] which stacked matrix (-1: an idle tile). A dense GEMM tiles the rows in
order; MoE prefill sorts its (row, expert) pairs by expert (`strata_jax.pallas.grouped_experts`).

Row invariance: a row's result depends only on its own activations, the weight and compile-time constants: the
products of a tile are per element (the tensor-core MMA computes every output element with the same reduction over
the step's K values, whatever the element's position in the tile), the unit kernel's epilogue is elementwise, the
activation pieces are elementwise, the K loop, its block size and its splits depend only on (format, n_out, K) and
the launch config's BN / KB / target_programs / precision, functions of the weight and the call site
(`kblock_config`, `moe_prefill_config`), never of the row count. The row sub-tiles (``SUB``) and pipelining stages
may follow the row count (`gemm`, `moe_prefill_config`): a sub-tile runs a BM-row tile's instructions and stages
only schedule loads, so neither changes a row's bits. So a row's bits are the same whatever the chunk's row count,
the row's position, or the other rows (not the GEMV's bits, nor the other kernel's: different summation orders).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from gguf.constants import GGMLQuantizationType as Q

from strata_jax.errors import UnsupportedError
from strata_jax.pallas import dispatch
from strata_jax.pallas.quant_matmul import decode as D
from strata_jax.pallas.quant_matmul import planar as P
from strata_jax.pallas.quant_matmul.gemv import decode_tile, split_k, split_step, tile_rows, vshape

PRECISIONS = {"bf16": 1, "bf16x2": 2, "bf16x3": 3}   # bfloat16 pieces of each inexact operand
# bf16x2 (2026-12-05): 1.4-1.8x bf16x3's TFLOP/s in the K-block kernel (H100, 512 rows), and every real-model
# parity test passes with the kernel GEMM (interpret) at bf16x2: test_dense_parity (SmolLM2-135M, Qwen2.5-Coder-0.5B:
# logits within 1e-3 of HF, 32 greedy tokens), test_relatives / test_hybrid "matches" (f32 within 1e-4 of HF, Q8_0
# within 1e-3 of the oracle); bf16 (one product) fails the SmolLM2 bound (2.5e-3). Now the precision of the GEMMs
# whose error a recurrence amplifies (`QLinear.precise`: GDN's q/k/v projection), of BF16 / F32 weights under F16,
# and of the unit kernel under F16.
PRECISE_PRECISION = "bf16x2"
# f16: one float16 x float16 product per step in the K-block GEMM (not a piece scheme: the block formats' weights and
# each activation row, scaled by a power of two so that its largest value is in [2^14, 2^15), rounded to float16
# once; the output row scaled back exactly). 8x less error than bf16 at bf16's one product; BF16 / F32 weights,
# which float16 may not hold, and the unit kernel keep PRECISE_PRECISION's pieces; the tensor-core GEMVs keep
# GEMV_PRECISION (`gemv_precision`).
F16 = "f16"
GEMM_PRECISIONS = (*PRECISIONS, F16)
# The prefill GEMM's default, dense and grouped experts (2026-12-07, fourth session). Parity (interpret,
# experiments/RESULTS.md): test_dense_parity passes at f16 on every GEMM; test_hybrid::test_q8_0_matches_oracle
# fails on qwen3next (5.9e-2 of the oracle, bound 1e-3) and qwen35moe (2.2e-3) with f16 on every GEMM, and the
# one GEMM that does it is GDN's q/k/v projection (f16 on it alone: 5.9e-2; on every other GEMM: 5.5e-4 / 6.2e-4 /
# 5.1e-4 on qwen3next / qwen35moe / qwen4exp), so that projection keeps PRECISE_PRECISION.
DEFAULT_PRECISION = F16
GEMV_PRECISION = "bf16x3"   # the tensor-core GEMVs of 1..8 decode rows (STRATA_QMATMUL_GEMV=tc / tc16): float32-like
WEIGHT_PIECES = {Q.F32: 3, Q.F16: 2, Q.BF16: 1}      # bfloat16 pieces of a float weight (block codes: 1, exact)
VARIANTS = ("kblock", "unit")
DEFAULT_VARIANT = "kblock"   # 1.2-2.2x the unit kernel at every precision and shape (H100, 2026-12-05)
# values per scale unit (one dl), where not 32
SUBBLOCK16 = frozenset({Q.Q2_K, Q.Q3_K, Q.Q6_K, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_M})


def takes_f16(qtype, precision: str, variant: str) -> bool:
    """Whether a GEMM call at ``precision`` runs `F16`'s one float16 product: the K-block kernel on block-format /
    F16 weights; BF16 / F32 weights, which float16 may not hold, and the unit kernel take `PRECISE_PRECISION`."""
    return precision == F16 and variant == "kblock" and qtype not in (Q.BF16, Q.F32)


def gemv_precision(precision: str) -> str:
    """The tensor-core GEMVs' precision under a `GEMM_PRECISIONS` setting: `GEMV_PRECISION` for the GEMM-only
    `F16`, else the setting itself."""
    return GEMV_PRECISION if precision == F16 else precision


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters: BN, BM, KB and target_programs a function of the weight and the kernel's use, never of the
    row count; SUB and num_stages, which leave a row's bits as they are, may follow it (module docstring).

    Raises:
      UnsupportedError: SUB < 1."""
    BN: int = 64                # weight rows per program
    BM: int = 64                # activation rows per program
    target_programs: int = 264  # split K while (weight tiles x splits) is below this (2 per H200 SM)
    num_warps: int = 4
    num_stages: int = 2
    KB: int = 0                 # kblock: K values per loop step (a power-of-two multiple of 32, reduced to divide
    #                             K); 0: BN, KB, warps and stages from `kblock_config` (BM, target and SUB kept)
    SUB: int = 1                # kblock: row sub-tiles of BM rows per program, sharing each decoded weight block
    #                             (each sub-tile's products are a BM-row tile's: the same bits whatever SUB)

    def __post_init__(self):
        if self.SUB < 1:
            raise UnsupportedError(f"row sub-tiles SUB={self.SUB}: must be >= 1")

    @property
    def tile_m(self) -> int:
        """Activation rows per program (SUB sub-tiles of BM rows): the row count of ``tile_rows``."""
        return self.BM * self.SUB


# Prefill: no K split (the row tiles fill the grid; a split would write and re-read partial sums of every row).
PREFILL = Config(target_programs=1)
GEMV_TC = Config(BN=32, BM=16, target_programs=2112)   # the tensor-core GEMV: 1..8 rows padded to 16
# grouped experts: a few rows per expert in a chunk. KB = 64 by measurement (H100, 2026-12-06, bench_kernels.py
# --only moe_prefill, Flash-Next experts, 512 rows, bf16x2): 3.03 ms per MoE block against 3.48 at the KB = 128 of
# KBLOCK_SMALL_BM, 3.27 with BN = 128, 3.74 with 32-row tiles (KB = 128); the unit kernel 5.13. One pipelining
# stage (H100, 2026-12-07, the same bench): 2.50 ms against 2.96 at 2 stages, 2.93 at 3; 2 warps 2.86, 8 warps 5.15.
# Re-swept at f16, the default precision since 2026-12-07c (H100, 2026-12-07e, bench_kernels.py --only f16_sweep):
# KB = 128 (`MOE_F16_KB`), one float16 product per step where bf16x2 had three, so the decode of a larger block
# pays: 512 rows uniform 1,604 us against 1,866 at KB = 64 (0.86x), skewed routers 1,744 against 1,999 (0.87x), 2048
# rows 4,053 against 4,477; KB = 256 1,581 / 1,761 / 4,116; 32-row tiles at KB = 128 1,642 on the skewed router.
# The other precisions keep KB = 64 (bf16x2 at KB = 128 took 3.48 ms against 3.03, 2026-12-06). Row sub-tiles (SUB)
# are picked per chunk by `moe_prefill_config`.
MOE_PREFILL = Config(BN=64, BM=16, KB=64, target_programs=1, num_stages=1)
MOE_F16_KB = 128
# expected (row, expert) pairs per expert from which SUB = 2 / 4 sub-tiles of BM rows share a decoded weight block.
# Measured at ~40 pairs (2048 rows of Flash-Next, KB = 128: SUB 4 2,670 us, SUB 2 3,450, SUB 1 4,053) and ~10 (512
# rows: uniform router SUB 1 1,604, SUB 2 1,930; skewed 1,744 / 1,804); the thresholds 16 / 32 lie between, unmeasured.
MOE_SUB_PAIRS = ((32, 4), (16, 2))


def moe_prefill_config(n_rows: int, k: int, n_experts: int, f16: bool = False) -> Config:
    """`MOE_PREFILL` (KB = `MOE_F16_KB` with ``f16``, the `F16` precision: a call-site constant) with row sub-tiles
    for a chunk of ``n_rows`` rows x top-``k`` of ``n_experts`` experts: SUB 4 from 32 (row, expert) pairs per
    expert on average, 2 from 16, else 1 (`MOE_SUB_PAIRS`). SUB may follow the chunk's row count: each sub-tile
    runs a BM-row tile's instructions (`_kernel_kblock`), so a row's bits do not depend on it
    (tests/pallas/test_grouped_experts.py::test_prefill_row_sub_tiles)."""
    pairs = n_rows * k / max(n_experts, 1)
    sub = next((s for at, s in MOE_SUB_PAIRS if pairs >= at), 1)
    return dataclasses.replace(MOE_PREFILL, SUB=sub, KB=MOE_F16_KB if f16 else MOE_PREFILL.KB)


# The K-block kernel's prefill tiles, picked by measurement (H100, 2026-12-05, experiments/bench_kernels.py --only
# prefill, `KBLOCK_SWEEP` there; experiments/RESULTS.md): BN = 64 weight rows x BM = 128 activation rows, KB = 64,
# 4 warps, 2 stages: at 512 rows and bf16x2, Q4_K 8960 x 1536 76.6 TFLOP/s (58.2 with BN = 128 over 8 warps, the
# first choice) and 1536 x 8960 68.7 (30.8 without the K split); at bf16x3 all six configs were within 4%.
# target_programs = 48 splits K for weights of few output tiles (1536 rows: 24 tiles, K split in 2; 256 rows: 4
# tiles, in up to 12), which otherwise leave most SMs idle at 512 rows; none for 8960 / 10240 rows. The partial
# sums cost ~4 bytes x N x M per split, small beside the products.
KBLOCK_PREFILL = Config(BN=64, BM=128, KB=64, target_programs=48, num_warps=4, num_stages=2)
KBLOCK_SMALL_BM = Config(BN=64, BM=16, KB=128, target_programs=1, num_warps=4, num_stages=2)  # BM <= 32 callers
# At f16 (H100, 2026-12-07e, bench_kernels.py --only f16_sweep, 512 rows; us, against KBLOCK_PREFILL as is): weights
# of many output tiles gain from a third pipelining stage (Q4_K 8960 x 1536 130.9 against 152.8, 10240 x 2560 208.3
# against 220.6), the others from 2 row sub-tiles of 128 rows sharing each decoded block (Q4_K 1536 x 8960 146.0
# against 162.9, Q6_K 1536 x 8960 173.0 against 218.9, Q4_K 1536 x 1536 45.3 against 72.5). Neither changes a
# row's bits (stages schedule the loads; a sub-tile runs a 128-row tile's instructions). At 2048 rows the two shapes
# measured there preferred the other choice (8960 x 1536: SUB 2 379.1 against 430.9; 1536 x 8960: 3 stages 436.8
# against 451.2): both being bit-neutral, a choice by row count is open (not yet swept: 512 is the default chunk).
KBLOCK_WIDE_N = 4096   # output rows from which a weight takes the third stage instead of the sub-tiles


def gemm_variant() -> str:
    """``STRATA_QMATMUL_GEMM``: the kernel of `tile_gemm` / `gemm`, ``kblock`` (default, `_kernel_kblock`) or
    ``unit`` (`_kernel_unit`, for comparisons). Read when a call is traced: `api` passes it as a static argument.

    Raises:
      UnsupportedError: another value."""
    return dispatch.env_choice("STRATA_QMATMUL_GEMM", DEFAULT_VARIANT, VARIANTS)


def kblock_config(qtype, n_out: int, k_in: int, BM: int | None = None,
                  target_programs: int | None = None, f16: bool = False) -> Config:
    """The K-block kernel's launch parameters for a weight: `KBLOCK_PREFILL` for prefill tiles (``BM`` None; with
    ``f16``, the `F16` precision, a third pipelining stage from `KBLOCK_WIDE_N` output rows, else 2 row sub-tiles
    of BM rows: a row's bits as with `KBLOCK_PREFILL` itself), or the caller's ``BM`` (row tiles of 16 for the
    tensor-core GEMV; `MOE_PREFILL` sets its own KB) with `KBLOCK_SMALL_BM`'s BN / KB / warps / stages when BM <=
    32; the caller's ``target_programs`` if given; ``KB`` halved until it divides K (`kblock_size`). A function of
    (n_out, K, BM, target_programs, f16) only, never of the row count."""
    del qtype
    base = KBLOCK_PREFILL if BM is None or BM > 32 else KBLOCK_SMALL_BM
    if BM is None and f16:   # prefill tiles at `F16`: `KBLOCK_WIDE_N` (the other precisions as swept at bf16x2)
        base = (dataclasses.replace(base, num_stages=3) if n_out >= KBLOCK_WIDE_N
                else dataclasses.replace(base, SUB=2))
    cfg = dataclasses.replace(base, BM=base.BM if BM is None else BM,
                              target_programs=base.target_programs if target_programs is None else target_programs)
    return dataclasses.replace(cfg, KB=kblock_size(k_in, cfg.KB))


def kblock_size(k_in: int, KB: int) -> int:
    """``KB`` (a power-of-two multiple of 32) halved until it divides K (down to one 32-value group).

    Raises:
      UnsupportedError: KB is not a power-of-two multiple of 32."""
    if KB < P.GROUP or KB % P.GROUP or not dispatch.is_pow2(KB // P.GROUP):
        raise UnsupportedError(f"KB={KB} is not a power-of-two multiple of {P.GROUP}")
    while KB > P.GROUP and (k_in // P.GROUP) % (KB // P.GROUP):
        KB //= 2
    return KB


def units(qtype) -> list[tuple[int, int]]:
    """The scale units of a 32-value group as (first index, length) along the first value axis."""
    vs = vshape(qtype)
    if qtype in SUBBLOCK16:
        h = vs[0] // 2
        return [(0, h), (h, h)]
    return [(0, vs[0])]


def bf16_pieces(v, n: int, rounded: bool = False):
    """float32 v -> n bfloat16 pieces, largest first, whose float32 sum approximates v (n = 3: exact but for
    subnormal remainders; n = 1: v rounded to bfloat16).

    Every piece but the last is v's remainder with its low 16 bits cleared (a bitcast and a mask): XLA:GPU drops a
    float32 -> bfloat16 -> float32 round trip as "excess precision", so the remainder of a rounded piece computed
    by XLA (outside a kernel, as `tcgemv.activation_tiles` does) came out zero and bf16x3 gave bf16 accuracy
    (3e-4 of |x|@|w| on the H200, 2026-12-04). ``rounded``: 0x8000 is added to the bits before the mask (round to
    nearest, ties away from zero; one integer add; finite |v| below bfloat16's largest value), so a remainder is
    at most half a bfloat16 ulp and of either sign, as in XLA's X3 split: with 2 pieces per operand the dropped
    product of the two remainders is ~4x smaller and unbiased (numpy emulation, random Q4_K 64 x 1024: max error /
    (|x| @ |w|) 8.9e-7 against 2.5e-6 truncated)."""
    out = []
    r = v.astype(jnp.float32)
    for i in range(n):
        if i == n - 1:
            out.append(r.astype(jnp.bfloat16))
            break
        b = lax.bitcast_convert_type(r, jnp.uint32)
        if rounded:
            b = b + jnp.uint32(0x8000)
        hi = lax.bitcast_convert_type(b & jnp.uint32(0xFFFF0000), jnp.float32)
        out.append(hi.astype(jnp.bfloat16))   # exact: hi has 8 significant bits
        r = r - hi
    return out


def piece_products(wp, xp, dot, acc=None):
    """The split product of a weight and an activation tile: the float32 sum of ``dot(wp[i], xp[j])`` over the
    pairs of bfloat16 pieces with ``i + j < max(len(wp), len(xp))`` (2 pieces each: the three products of order
    < 2, as in XLA's ``BF16_BF16_F32_X3``; 3 activation pieces of an exact weight: 3 products), smallest order
    first (the small terms are summed before the large one). ``acc``: added to first, ``acc + d0 + d1 ...`` (on the
    GPU each add becomes its MMA's accumulator)."""
    n = max(len(wp), len(xp))
    pu = acc
    for order in range(n - 1, -1, -1):
        for wi in range(len(wp)):
            xi = order - wi
            if 0 <= xi < len(xp):
                d = dot(wp[wi], xp[xi])
                pu = d if pu is None else pu + d
    return pu


def _dot(a, b):
    """a [BN, K] @ b [BM, K]^T in float32 (bfloat16 operands on the tensor cores)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel_unit(texp_ref, trows_ref, w_ref, x_ref, *refs, qtype, n_out, k_in, BN, BM, cps, n_groups, masked,
                 x_pieces, table_names):
    tables = dict(zip(table_names, refs[:len(table_names)]))
    o_ref = refs[len(table_names)]
    i = pl.program_id(0)
    s = pl.program_id(1)
    t = pl.program_id(2)
    e = texp_ref[t]
    vs = vshape(qtype)
    nd = 2 + len(vs)
    inner = math.prod(vs[1:])
    w_pieces = WEIGHT_PIECES.get(qtype, 1)

    @pl.when(e >= 0)
    def _():
        rows = tile_rows(i, e, BN, n_out, nd)
        xrows = trows_ref[t].reshape(BM, 1)

        def body(j, acc):
            c, live = split_step(s, j, cps, n_groups, masked)
            grp = jnp.full((1,), c, jnp.int32)
            for a0, n_a in units(qtype):
                W = n_a * inner
                f, dl, mn = decode_tile(qtype, w_ref, rows, grp, k_in, tables, a0, n_a)
                col = c * P.GROUP + a0 * inner + lax.broadcasted_iota(jnp.int32, (1, W), 1)
                xu = x_ref[xrows * k_in + col].astype(jnp.float32)                  # [BM, W]
                xp = bf16_pieces(xu, x_pieces)
                pu = piece_products(bf16_pieces(f.reshape(BN, W), w_pieces), xp, _dot)
                if dl is not None:
                    dlu = jnp.max(dl, axis=tuple(range(1, nd))).reshape(BN, 1)
                    pu = dlu * pu
                    if mn is not None:
                        mnu = jnp.max(mn, axis=tuple(range(1, nd))).reshape(BN, 1)
                        pu = pu + mnu * jnp.sum(xu, axis=1).reshape(1, BM)
                acc = acc + (jnp.where(live, pu, 0.0) if masked else pu)
            return acc

        acc = lax.fori_loop(0, cps, body, jnp.zeros((BN, BM), jnp.float32))
        o_ref[t, s, pl.ds(i * BN, BN), :] = acc


def _kernel_kblock(texp_ref, trows_ref, w_ref, x_ref, *refs, qtype, n_out, k_in, m_x, BN, BM, SUB, G, cps,
                   n_steps, masked, w_pieces, x_pieces, table_names, f16=False):
    """One [BN, SUB * BM] tile, K in blocks of G groups (module docstring): each step's decoded weights serve the
    SUB row sub-tiles, each with its own [BN, BM] products and accumulator (a BM-row tile's instructions).
    ``x_ref``: the activations' bfloat16 pieces, flat [x_pieces, m_x, K] (``f16``: the scaled float16 rows, one
    piece, and the weights rounded to float16); ``o_ref`` [T, splits, SUB * BM, n_pad] (rows of x minor: no
    transpose after the call)."""
    tables = dict(zip(table_names, refs[:len(table_names)]))
    o_ref = refs[len(table_names)]
    i = pl.program_id(0)
    s = pl.program_id(1)
    t = pl.program_id(2)
    e = texp_ref[t]
    nd = 2 + len(vshape(qtype))
    KB = G * P.GROUP

    @pl.when(e >= 0)
    def _():
        rows = tile_rows(i, e, BN, n_out, nd)
        col = lax.broadcasted_iota(jnp.int32, (1, KB), 1)
        # hoisted: Triton then moves these [BM, KB] offsets between layouts every step (sass_probe: ~half the loop's
        # instructions at BM = 128); formed inside the loop they do not, but the 1.5B prefill measured 0.93x
        # (H100, 2026-12-07, experiments/RESULTS.md): the loop is not bound by its instruction count
        xoff = [trows_ref[t, pl.ds(u * BM, BM)].reshape(BM, 1) * k_in + col for u in range(SUB)]   # [BM, KB]

        def body(j, accs):
            c, live = split_step(s, j, cps, n_steps, masked)
            f, dl, mn = decode_tile(qtype, w_ref, rows, c * G + lax.broadcasted_iota(jnp.int32, (G,), 0), k_in,
                                    tables)
            w = f if dl is None else dl * f      # `decode.values`: the weights of `planar.dequantize`
            if mn is not None:
                w = w + mn
            wp = ([w.reshape(BN, KB).astype(jnp.float16)] if f16
                  else bf16_pieces(w.reshape(BN, KB), w_pieces, rounded=True))
            out = []
            for u in range(SUB):
                xp = [x_ref[p * (m_x * k_in) + c * KB + xoff[u]] for p in range(x_pieces)]   # [BM, KB]
                new = piece_products(wp, xp, _dot, accs[u])
                out.append(jnp.where(live, new, accs[u]) if masked else new)
            return tuple(out)

        accs = lax.fori_loop(0, cps, body, tuple(jnp.zeros((BN, BM), jnp.float32) for _ in range(SUB)))
        for u in range(SUB):
            o_ref[t, s, pl.ds(u * BM, BM), pl.ds(i * BN, BN)] = accs[u].T


def _pow2(k):
    """2.0 ** k, float32, exactly (int32 k in [-126, 127]: the exponent field set directly)."""
    return lax.bitcast_convert_type((k + 127).astype(jnp.uint32) << 23, jnp.float32)


def f16_rows(x):
    """The `F16` precision's activations: x [M, K] -> (float16 x * 2^k_r, float32 [M] 2^-k_r), k_r per row such
    that the row's largest |value| lands in [2^14, 2^15) (below float16's 65504; all-zero rows and extreme rows
    clamped to |k| <= 126). Depends on the row alone; the scalings are exact."""
    x = x.astype(jnp.float32)
    _, e = jnp.frexp(jnp.max(jnp.abs(x), axis=1))         # max = m 2^e, m in [0.5, 1)
    k = jnp.clip(15 - e, -126, 126).astype(jnp.int32)
    return (x * _pow2(k)[:, None]).astype(jnp.float16), _pow2(-k)


def operand_pieces(qtype, x_dtype, precision: str) -> tuple[int, int]:
    """(weight pieces, activation pieces) of the K-block kernel at ``precision``: `PRECISIONS`' count, fewer for
    an operand exact in fewer bfloat16 pieces (BF16 weights 1, F16 2; bfloat16 activations 1, float16 2)."""
    n = PRECISIONS[precision]
    x_exact = {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}.get(jnp.dtype(x_dtype), n)
    return min(n, WEIGHT_PIECES.get(qtype, n)), min(n, x_exact)


def why_not(qtype, n_out: int, k_in: int, w_dtype, n_mats: int = 1) -> str | None:
    """None when the tensor-core kernel serves this weight, else the reason."""
    from strata_jax.pallas.quant_matmul.gemv import why_not as gemv_why_not
    return gemv_why_not(qtype, n_out, k_in, w_dtype, n_mats)


def tile_gemm(x, w_stacked, tile_expert, tile_rows, qtype, n_out: int, k_in: int, *, interpret: bool,
              precision: str = DEFAULT_PRECISION, cfg: Config = PREFILL, variant: str | None = None):
    """Tiles of rows of x times their tile's matrix: out[t, b] = x[tile_rows[t, b]] @ W[tile_expert[t]]^T.

    Args:
      x: [Mx, K] float32 / bfloat16 / float16.
      w_stacked: [E, n_out, row_words] uint32 planar, or [E, n_out, K] F32 / F16 / BF16.
      tile_expert: int32 [T] (-1: idle tile, output not written); tile_rows: int32 [T, cfg.tile_m] valid rows of
        x.
      precision: one of `GEMM_PRECISIONS` (`F16`: the kblock kernel on block-format / F16 weights; elsewhere
        `PRECISE_PRECISION`).
      cfg: the launch parameters (its `Config.tile_m` is the tiles' row count; the kblock kernel takes BN / KB /
        warps / stages from `kblock_config` unless ``cfg.KB`` is set).
      variant: the kernel, one of `VARIANTS` (None: `gemm_variant`, the environment).
    Returns: float32 [T, cfg.tile_m, n_out]. Not jitted.

    Raises:
      UnsupportedError: unknown precision or variant, tile_rows not [T, cfg.tile_m], SUB > 1 on the unit kernel,
        or a KB that is not a power-of-two multiple of 32.
    """
    if precision not in GEMM_PRECISIONS:
        raise UnsupportedError(f"qmatmul precision {precision!r} is not one of {list(GEMM_PRECISIONS)}")
    variant = gemm_variant() if variant is None else variant
    if variant not in VARIANTS:
        raise UnsupportedError(f"gemm variant {variant!r} is not one of {VARIANTS}")
    f16 = takes_f16(qtype, precision, variant)
    if precision == F16 and not f16:   # the unit kernel, and weights float16 may not hold
        precision = PRECISE_PRECISION
    T_in = tile_expert.shape[0]
    if tile_rows.shape != (T_in, cfg.tile_m):
        raise UnsupportedError(f"tile_rows {tile_rows.shape} must be [{T_in}, {cfg.tile_m}]")
    if cfg.SUB != 1 and variant != "kblock":
        raise UnsupportedError(f"row sub-tiles (SUB={cfg.SUB}) are a kblock launch parameter, not {variant}'s")
    tile_expert = tile_expert.astype(jnp.int32)
    tile_rows = tile_rows.astype(jnp.int32)
    if interpret and T_in < 2:  # keep the interpreter's grid loop (see gemv.grouped_gemv)
        tile_expert = jnp.concatenate([tile_expert, jnp.full((1,), -1, jnp.int32)])
        tile_rows = jnp.concatenate([tile_rows, tile_rows[:1]])
    T = tile_expert.shape[0]
    n_groups = k_in // P.GROUP
    names = D.TABLES.get(qtype, ())
    tabs = [jnp.asarray(D.table(n)) for n in names]
    full = pl.no_block_spec
    qname = getattr(qtype, "name", qtype)
    if variant == "kblock":
        cfg = (dataclasses.replace(cfg, KB=kblock_size(k_in, cfg.KB)) if cfg.KB
               else dataclasses.replace(kblock_config(qtype, n_out, k_in, cfg.BM, cfg.target_programs), SUB=cfg.SUB))
        G = cfg.KB // P.GROUP
        n_steps = n_groups // G
        n_tiles = -(-n_out // cfg.BN)
        sp = split_k(n_steps, n_tiles, 1, cfg.target_programs)
        if f16:
            w_pieces = x_pieces = 1
            xp, x_back = f16_rows(x)                                                   # float16 [Mx, K]
        else:
            w_pieces, x_pieces = operand_pieces(qtype, x.dtype, precision)
            # the activations' pieces once per call (elementwise: a row's pieces are its own), not in every program
            xp = jnp.stack(bf16_pieces(x.astype(jnp.float32), x_pieces, rounded=True))  # bfloat16 [p, Mx, K]
        kernel = functools.partial(
            _kernel_kblock, qtype=qtype, n_out=n_out, k_in=k_in, m_x=x.shape[0], BN=cfg.BN, BM=cfg.BM, SUB=cfg.SUB,
            G=G, cps=sp["cps"], n_steps=n_steps, masked=sp["masked"], w_pieces=w_pieces, x_pieces=x_pieces,
            table_names=names, f16=f16)
        out_shape = (T, sp["split"], cfg.tile_m, n_tiles * cfg.BN)
        name = f"qmatmul_tc_{qname}_kblock"
    else:
        n_tiles = -(-n_out // cfg.BN)
        sp = split_k(n_groups, n_tiles, 1, cfg.target_programs)
        xp = x
        kernel = functools.partial(
            _kernel_unit, qtype=qtype, n_out=n_out, k_in=k_in, BN=cfg.BN, BM=cfg.BM, cps=sp["cps"],
            n_groups=n_groups, masked=sp["masked"], x_pieces=PRECISIONS[precision], table_names=names)
        out_shape = (T, sp["split"], n_tiles * cfg.BN, cfg.BM)
        name = f"qmatmul_tc_{qname}"
    call = dispatch.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(out_shape, jnp.float32)], grid=(n_tiles, sp["split"], T),
        in_specs=[full] * (4 + len(tabs)), out_specs=[full], interpret=interpret, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, name=name)
    (part,) = call(tile_expert, tile_rows, w_stacked.reshape(-1), xp.reshape(-1), *tabs)
    out = part[:, 0]
    for j in range(1, sp["split"]):  # fixed order
        out = out + part[:, j]
    if variant == "unit":
        out = jnp.swapaxes(out, 1, 2)
    elif f16:   # each row back to its scale (a power of two: exact)
        out = out * x_back[tile_rows][:, :, None]
    return out[:T_in, :, :n_out]


def gemm(x, w, qtype, n_out: int, k_in: int, *, interpret: bool, precision: str = DEFAULT_PRECISION,
         cfg: Config | None = None, variant: str | None = None):
    """x [M, K] times one weight [n_out, K]^T -> float32 [M, n_out], rows in tiles of ``cfg.tile_m`` (any M; the
    tensor-core GEMV is ``cfg=GEMV_TC``). ``cfg`` None: the prefill tiles of the variant (`kblock_config`, no row
    sub-tiles for M <= BM; `PREFILL` for ``unit``); ``variant`` as in `tile_gemm`. Not jitted."""
    variant = gemm_variant() if variant is None else variant
    M = x.shape[0]
    if cfg is None:
        cfg = (kblock_config(qtype, n_out, k_in, f16=takes_f16(qtype, precision, variant))
               if variant == "kblock" else PREFILL)
        if cfg.SUB > 1 and M <= cfg.BM:   # one row tile: a second sub-tile would be padding (bit-neutral: SUB)
            cfg = dataclasses.replace(cfg, SUB=1)
    TM = cfg.tile_m
    T = -(-M // TM)
    rows = jnp.minimum(jnp.arange(T * TM, dtype=jnp.int32), M - 1).reshape(T, TM)
    y = tile_gemm(x, w[None], jnp.zeros((T,), jnp.int32), rows, qtype, n_out, k_in, interpret=interpret,
                  precision=precision, cfg=cfg, variant=variant)
    return y.reshape(T * TM, n_out)[:M]
