"""Pallas tensor-core GEMV for 1..16 activation rows on planar (`planar`) and F16 / BF16 / F32 weights
(``STRATA_QMATMUL_GEMV=tc16``): every tile of rows padded to 16, one compiled kernel per weight for all M.

Source: block formats of ggml via `strata_jax.pallas.quant_matmul.decode`; the split products are `gemm`'s
(``bf16x3`` / ``bf16x2`` / ``bf16`` activation pieces, `gemm.bf16_pieces` and `gemm.piece_products`); the
GEMV design points (many weight bytes in flight per SM, activations shared by all the weight rows of a program)
as in llama.cpp's MMVQ (``ggml/src/ggml-cuda/mmvq.cu``).

Why a second tensor-core GEMV. The diagnosis of `gemm.tile_gemm` with `gemm.GEMV_TC` (H200 2026-12-02: 0.01-0.08
of the bandwidth ceiling at any row count, BF16 0.18, where the FMA GEMV reaches 0.26-0.95 at one row); the
register / instruction figures come from compiling its Triton IR (as Pallas lowers it) for sm_90 with the
``triton`` 3.9 package on a CPU (the H200's jaxlib bundles another Triton build: approximate):

* tiny steps, latency-bound: a program (BN = 32 weight rows) reads one 32-value group per loop step, i.e.
  32 x 16 = 512 bytes of Q4_K codes (+ 5 scale words per row), waits, decodes, and runs three
  [32, 32] x [32, 16] MMAs (``mma.sync``). On the 8192 x 28672 bench shape the grid is 256 tiles x 8 K splits =
  2048 programs of 112 steps, ~4 waves (104 registers: 4 programs per SM): ~2.7 us per step, ~2-5 KB of DRAM
  traffic in flight per SM where ~30 KB are needed to cover the latency at 3.9 TB/s. The time hardly depends on
  the bytes (Q4_K 132 MB / Q8_0 250 MB / BF16 470 MB: 1171 / 839 / 676 us); BN = 64 halves the steps and the
  time (tc_64_4: 565 us).
* activations gathered per step through ``tile_rows`` (pointers from indices loaded at run time: scalar loads
  Triton cannot vectorise), 16 rows x 32 f32 = 2 KB per step per program (4x the Q4_K weight bytes, re-read by
  each of the 256 tiles: 470 MB of L2 traffic), then cut into bf16 pieces and transposed (3 ``tt.trans``) in
  every program; 8 layout conversions through shared memory and 6 barriers per step. The loop is 358
  instructions per thread for 576 weight bytes: 2.5 warp instructions per byte, i.e. even at one instruction per
  scheduler and cycle it could reach only ~0.11 of the ceiling for Q4_K (the FMA GEMV: 0.48 at 1 row, 0.12 at
  8 rows by the same count; measured 0.26 / 0.05).

This kernel (one program = BN weight rows x a K range, x 16 activation rows):

* the activations are cut into bf16 pieces once, outside the kernel (XLA, elementwise), stored K-major as
  ``[tiles, pieces, K, 16]``: each step reads contiguous [unit, 16] bf16 tiles that feed the MMA's B operand with
  no transpose (Triton 3.9 streams them to shared memory with ``cp.async`` across loop steps); for a format with
  a min, the unit sums of the f32 activations ``[tiles, K / unit, 16]`` (a fixed chain of elementwise adds) give
  the ``mn * sum x`` term;
* a loop step covers G groups of 32 values decoded in registers by the shared decoders (`gemv.decode_tile`, one
  group at a time: no slicing of register tensors), one MMA ``[BN, unit] x [unit, 16]`` per piece pair and scale
  unit (16 or 32 values; `gemm.piece_products`), then ``acc += dl * P`` and ``acc += mn * s`` (two FMAs per
  element; a clamped step of a ragged split has dl = mn = 0);
* the grid is (BN-row tiles, K splits, row tiles), the split count a function of (format, N, K) only
  (`Config.target_programs`: about two programs per SM), the partial sums added in a fixed order afterwards.

Compiled the same way (BN = 128, G = 2, 4 warps, 8 rows): ``wgmma`` (HGMMA 64x16x16), 130 registers (Q6_K
199), no spills, 24 KB of shared memory; Q4_K's loop is 731 instructions per thread for 4.6 KB of weights, 6x
fewer instructions per byte than the kernel above, so the issue bound is ~0.42 of the ceiling for Q4_K (Q6_K
~0.39, Q8_0 ~0.95, BF16 not issue-bound) whatever M <= 16. What is left per byte is the decode itself (shift,
mask, magic OR, float subtract and bf16 pack per value: ~4.5 instructions) and the per-unit epilogue over 16
columns; the tensor cores add a second bound: at ``bf16x3`` a 32-value unit of 128 rows costs 12 HGMMA 64x16x16
(~190 cycles at the dense bf16 rate) for 2.3 KB of Q4_K (~155 cycles of bandwidth), so formats of <= 4.5 bits
need ``bf16x2`` (2 pieces) to leave the bandwidth the bound.

Row invariance: each MMA output element (weight row n, activation column r) is a sum over the unit's K values
of its own row and column, computed the same way whatever the element's position or the other rows; the
epilogue is elementwise; the K loop, G, the split count and the piece order depend only on (format, n_out, K)
and compile-time constants; padding rows are zeros. So row r's bits are the same for M = 1..16, whatever the
other rows hold, and in every 16-row tile of a larger M (`gemv` with more rows runs several tiles). The bits are
not those of the FMA GEMV (`gemv`) or of the GEMM (`gemm`): other summation orders.

Accuracy (interpret mode, tests/pallas/test_planar.py; max |y - y64| / (|x| @ |w|) against float64):
~2e-8 at ``bf16x3`` (the three pieces reproduce the activations exactly; the loss is the float32
accumulation), ~5e-7 at ``bf16x2``.
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
from strata_jax.pallas.quant_matmul.gemm import (GEMV_PRECISION, PRECISIONS, WEIGHT_PIECES, bf16_pieces,
                                                 piece_products, units)
from strata_jax.pallas.quant_matmul.gemv import decode_tile, split_step, tile_rows, tiling, vshape

ROWS = 16   # activation rows per tile: the MMA's N (Triton's smallest dot size)
#: formats whose decoded weights carry an offset ``mn`` per scale unit: the kernel reads the activations' unit sums
WITH_MIN = frozenset({Q.Q4_1, Q.Q5_1, Q.Q2_K, Q.Q4_K, Q.Q5_K})


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters of the tensor-core GEMV (a function of the weight only, never of the row count)."""
    BN: int = 128               # weight rows per program (the MMA's M)
    G: int = 2                  # 32-value groups per loop step (reduced to divide K / 32)
    target_programs: int = 264  # split K while (weight tiles x splits) is below this (2 per H200 SM)
    num_warps: int = 4
    num_stages: int = 2


DEFAULT = Config()


def choose_config(qtype, n_out: int, k_in: int) -> Config:
    """Launch parameters for a weight (first choice, to be tuned by experiments/bench_kernels.py on the H200):
    BN shrinks for small matrices so that the grid still has a few programs per SM before K is split."""
    del qtype, k_in
    bn = DEFAULT.BN
    while bn > 32 and -(-n_out // bn) < 64:
        bn //= 2
    return dataclasses.replace(DEFAULT, BN=bn)


def unit_len(qtype) -> int:
    """Values per scale unit (16 or 32) along K."""
    return units(qtype)[0][1] * math.prod(vshape(qtype)[1:])


def _dot(a, b):
    """a [BN, K] @ b [K, 16] in float32 (bfloat16 operands on the tensor cores; b is K-major: no transpose)."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _kernel(texp_ref, w_ref, x_ref, *refs, qtype, n_out, k_in, BN, G, cps, n_chunks, masked, x_pieces, with_min,
            table_names):
    s_ref = refs[0] if with_min else None
    refs = refs[1:] if with_min else refs
    tables = dict(zip(table_names, refs[:len(table_names)]))
    o_ref = refs[len(table_names)]
    i = pl.program_id(0)
    s = pl.program_id(1)
    t = pl.program_id(2)
    e = texp_ref[t]            # the stacked matrix of this row tile (-1: an idle tile, output not written)
    vs = vshape(qtype)
    nd = 2 + len(vs)
    inner = math.prod(vs[1:])
    w_pieces = WEIGHT_PIECES.get(qtype, 1)
    ulen = unit_len(qtype)

    @pl.when(e >= 0)
    def _():
        rows = tile_rows(i, e, BN, n_out, nd)

        def body(j, acc):
            c, live = split_step(s, j, cps, n_chunks, masked)
            for g in range(G):
                grp_i = c * G + g
                grp = jnp.full((1,), grp_i, jnp.int32)
                for a0, n_a in units(qtype):
                    W = n_a * inner
                    k0 = grp_i * P.GROUP + a0 * inner
                    f, dl, mn = decode_tile(qtype, w_ref, rows, grp, k_in, tables, a0, n_a)
                    xp = [x_ref[t, p, pl.ds(k0, W), :] for p in range(x_pieces)]        # bf16 [W, 16] each
                    pu = piece_products(bf16_pieces(f.reshape(BN, W), w_pieces), xp, _dot)
                    # the unit's scale and min as [BN, 1] (zero on a clamped step), then two FMAs per element
                    dlu = 1.0 if dl is None else jnp.max(dl, axis=tuple(range(1, nd))).reshape(BN, 1)
                    if masked:
                        dlu = jnp.where(live, dlu, 0.0)
                    acc = acc + dlu * pu
                    if mn is not None:
                        assert with_min, f"{qtype.name} has a min: add it to WITH_MIN"
                        mnu = jnp.max(mn, axis=tuple(range(1, nd))).reshape(BN, 1)
                        if masked:
                            mnu = jnp.where(live, mnu, 0.0)
                        acc = acc + mnu * s_ref[t, pl.ds(k0 // ulen, 1), :]              # unit sums [1, 16]
            return acc

        acc = lax.fori_loop(0, cps, body, jnp.zeros((BN, ROWS), jnp.float32))
        o_ref[t, s, pl.ds(i * BN, BN), :] = acc


def activation_tiles(x, qtype, precision: str):
    """x [T, 16, K] float -> (bf16 pieces [T, pieces, K, 16], unit sums float32 [T, K / unit, 16] or None).

    Elementwise (and a fixed chain of adds for the sums), so each row's values depend on that row alone."""
    T, _, K = x.shape
    x32 = x.astype(jnp.float32)
    xp = jnp.stack(bf16_pieces(x32, PRECISIONS[precision]), axis=1)          # [T, pieces, 16, K]
    xp = jnp.swapaxes(xp, 2, 3)
    if qtype not in WITH_MIN:
        return xp, None
    ul = unit_len(qtype)
    xu = x32.reshape(T, ROWS, K // ul, ul)
    su = xu[..., 0]
    for v in range(1, ul):  # in order (no tree XLA could reshape by M)
        su = su + xu[..., v]
    return xp, jnp.swapaxes(su, 1, 2)


def grouped_gemv(x, w_stacked, tile_expert, qtype, n_out: int, k_in: int, *, interpret: bool,
                 precision: str = GEMV_PRECISION, cfg: Config | None = None):
    """For each row tile t: x[t] [16, K] times the matrix ``w_stacked[tile_expert[t]]`` [n_out, K]^T.

    Args:
      x: [T, 16, K] float32 / bfloat16 / float16 (unused rows: zeros).
      w_stacked: [E, n_out, row_words] uint32 planar, or [E, n_out, K] F32 / F16 / BF16.
      tile_expert: int32 [T]: the matrix each tile reads, or -1 (an idle tile: its output is not written).
      precision: one of `gemm.PRECISIONS`.
    Returns: float32 [T, 16, n_out]. Not jitted.

    Raises:
      UnsupportedError: unknown precision, or x not [T, 16, K].
    """
    if precision not in PRECISIONS:
        raise UnsupportedError(f"qmatmul precision {precision!r} is not one of {sorted(PRECISIONS)}")
    if x.ndim != 3 or x.shape[1] != ROWS or x.shape[2] != k_in or tile_expert.shape != x.shape[:1]:
        raise UnsupportedError(f"x {x.shape} must be [T, {ROWS}, {k_in}] with tile_expert [T], "
                               f"got {tile_expert.shape}")
    T_in = x.shape[0]
    tile_expert = tile_expert.astype(jnp.int32)
    if interpret and T_in < 2:  # keep the interpreter's grid loop (see gemv.grouped_gemv)
        tile_expert = jnp.concatenate([tile_expert, jnp.full((1,), -1, jnp.int32)])
        x = jnp.concatenate([x, x[:1]])
    T = x.shape[0]
    cfg = cfg or choose_config(qtype, n_out, k_in)
    t = tiling(qtype, n_out, k_in, cfg)   # `gemv.tiling` per weight: the split never follows the row tiles T
    xp, su = activation_tiles(x, qtype, precision)
    names = D.TABLES.get(qtype, ())
    tabs = [jnp.asarray(D.table(n)) for n in names]
    n_pad = t["n_tiles"] * cfg.BN
    ins = [tile_expert, w_stacked.reshape(-1), xp] + ([su] if su is not None else []) + tabs
    full = pl.no_block_spec
    call = dispatch.pallas_call(
        functools.partial(_kernel, qtype=qtype, n_out=n_out, k_in=k_in, BN=cfg.BN, G=t["G"], cps=t["cps"],
                          n_chunks=t["n_chunks"], masked=t["masked"], x_pieces=PRECISIONS[precision],
                          with_min=su is not None, table_names=names),
        out_shape=[jax.ShapeDtypeStruct((T, t["split"], n_pad, ROWS), jnp.float32)],
        grid=(t["n_tiles"], t["split"], T), in_specs=[full] * len(ins), out_specs=[full],
        interpret=interpret, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        name=f"qmatmul_tc16_{getattr(qtype, 'name', qtype)}")
    (part,) = call(*ins)
    out = part[:, 0]
    for j in range(1, t["split"]):  # fixed order
        out = out + part[:, j]
    return jnp.swapaxes(out[:T_in, :n_out], 1, 2)


def gemv(x, w, qtype, n_out: int, k_in: int, *, interpret: bool, precision: str = GEMV_PRECISION,
         cfg: Config | None = None):
    """x [M, K] times one weight [n_out, K]^T -> float32 [M, n_out], any M, in 16-row tiles (zero padded; the
    weight is read once per tile): row r's bits are the same for every M and whatever the other rows hold.
    Not jitted."""
    M = x.shape[0]
    T = -(-M // ROWS)
    xt = jnp.pad(x, [(0, T * ROWS - M), (0, 0)]).reshape(T, ROWS, k_in)
    y = grouped_gemv(xt, w[None], jnp.zeros((T,), jnp.int32), qtype, n_out, k_in, interpret=interpret,
                     precision=precision, cfg=cfg)
    return y.reshape(T * ROWS, n_out)[:M]
