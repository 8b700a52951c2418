"""Pallas tensor-core matmul on planar (`planar`) and F16 / BF16 / F32 weights, over tiles of activation rows:
the prefill GEMM, the grouped-expert GEMM of MoE prefill, and a tensor-core variant of the 1..8-row GEMV.

Source: block formats of ggml via `strata_jax.pallas.quant_matmul.decode`; the split products are the bf16x3
scheme (as in XLA's ``BF16_BF16_F32_X3`` dot algorithm), applied to the activations only.

Each program computes a ``[BN weight rows, BM activation rows]`` tile. Per scale unit of the weight (16 or 32
values: a sub-block with one ``dl``) it decodes the integer codes, which are exact in bfloat16 (|code| <= 256),
and multiplies them on the tensor cores against the unit's activations cut into bfloat16 pieces
``x = x0 + x1 + x2`` (`PRECISIONS`: ``bf16`` keeps x0 only, ~3e-3 relative; ``bf16x2`` x0 + x1, ~1e-5;
``bf16x3`` all three, float32 accuracy), each product accumulated in float32; then ``acc += dl * P + mn * sum x``
once per unit. F16 / F32 weights are cut into 2 / 3 bfloat16 pieces the same way (pairs of pieces whose order sum
is at least the piece count are dropped, as in bf16x3). The weight tile is never materialised in memory: codes go
from registers to the tensor cores.

Row tiles: ``tile_rows`` [T, BM] lists which activation rows each tile reads (padding repeats a valid row; its
output is ignored) and ``tile_expert`` [T] which stacked matrix (-1: an idle tile). A dense GEMM tiles the rows in
order; MoE prefill sorts its (row, expert) pairs by expert (`strata_jax.pallas.grouped_experts`).

Row invariance: a row's result depends only on its own activations and the weight: the products of a tile are
per element (the tensor-core MMA computes every output element with the same reduction over the unit's K
values, whatever the element's position in the tile), the per-unit epilogue is elementwise, the K loop and its
splits depend only on (format, n_out, K). So a row's bits are the same whatever the chunk's row count, the row's
position, or the other rows (not the GEMV's bits: a different summation order).
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

PRECISIONS = {"bf16": 1, "bf16x2": 2, "bf16x3": 3}   # bfloat16 pieces of the activations
DEFAULT_PRECISION = "bf16x3"
WEIGHT_PIECES = {Q.F32: 3, Q.F16: 2, Q.BF16: 1}      # bfloat16 pieces of a float weight (block codes: 1, exact)
# values per scale unit (one dl), where not 32
SUBBLOCK16 = frozenset({Q.Q2_K, Q.Q3_K, Q.Q6_K, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_M})


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters (a function of the weight and the kernel's use, never of the row count)."""
    BN: int = 64                # weight rows per program
    BM: int = 64                # activation rows per program
    target_programs: int = 264  # split K while (weight tiles x splits) is below this (2 per H200 SM)
    num_warps: int = 4
    num_stages: int = 2


# Prefill: no K split (the row tiles fill the grid; a split would write and re-read partial sums of every row).
PREFILL = Config(target_programs=1)
GEMV_TC = Config(BN=32, BM=16, target_programs=2112)   # the tensor-core GEMV: 1..8 rows padded to 16
MOE_PREFILL = Config(BN=64, BM=16, target_programs=1)  # grouped experts: a few rows per expert in a chunk


def units(qtype) -> list[tuple[int, int]]:
    """The scale units of a 32-value group as (first index, length) along the first value axis."""
    vs = vshape(qtype)
    if qtype in SUBBLOCK16:
        h = vs[0] // 2
        return [(0, h), (h, h)]
    return [(0, vs[0])]


def bf16_pieces(v, n: int):
    """float32 v -> n bfloat16 pieces, largest first, whose float32 sum approximates v (n = 3: exact but for
    subnormal remainders; n = 1: v rounded to bfloat16).

    Every piece but the last is v's remainder with its low 16 bits cleared (a bitcast and a mask): XLA:GPU drops a
    float32 -> bfloat16 -> float32 round trip as "excess precision", so the remainder of a rounded piece computed
    by XLA (outside a kernel, as `tcgemv.activation_tiles` does) came out zero and bf16x3 gave bf16 accuracy
    (3e-4 of |x|@|w| on the H200, 2026-12-04)."""
    out = []
    r = v.astype(jnp.float32)
    for i in range(n):
        if i == n - 1:
            out.append(r.astype(jnp.bfloat16))
            break
        hi = lax.bitcast_convert_type(lax.bitcast_convert_type(r, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32)
        out.append(hi.astype(jnp.bfloat16))   # exact: hi has 8 significant bits
        r = r - hi
    return out


def piece_products(wp, xp, dot):
    """The split product of a weight and an activation tile: the float32 sum of ``dot(wp[i], xp[j])`` over the
    pairs of bfloat16 pieces with ``i + j < max(len(wp), len(xp))`` (bf16x3: the three products of order < 3 kept,
    as in XLA's ``BF16_BF16_F32_X3``), smallest order first (the small terms are summed before the large one)."""
    n = max(len(wp), len(xp))
    pu = None
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


def _kernel(texp_ref, trows_ref, w_ref, x_ref, *refs, qtype, n_out, k_in, BN, BM, cps, n_groups, masked,
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


def why_not(qtype, n_out: int, k_in: int, w_dtype, n_mats: int = 1) -> str | None:
    """None when the tensor-core kernel serves this weight, else the reason."""
    from strata_jax.pallas.quant_matmul.gemv import why_not as gemv_why_not
    return gemv_why_not(qtype, n_out, k_in, w_dtype, n_mats)


def tile_gemm(x, w_stacked, tile_expert, tile_rows, qtype, n_out: int, k_in: int, *, interpret: bool,
              precision: str = DEFAULT_PRECISION, cfg: Config = PREFILL):
    """Tiles of rows of x times their tile's matrix: out[t, b] = x[tile_rows[t, b]] @ W[tile_expert[t]]^T.

    Args:
      x: [Mx, K] float32 / bfloat16 / float16.
      w_stacked: [E, n_out, row_words] uint32 planar, or [E, n_out, K] F32 / F16 / BF16.
      tile_expert: int32 [T] (-1: idle tile, output not written); tile_rows: int32 [T, BM] valid rows of x.
      precision: one of `PRECISIONS`.
    Returns: float32 [T, BM, n_out]. Not jitted.

    Raises:
      UnsupportedError: unknown precision, or tile_rows not [T, cfg.BM].
    """
    if precision not in PRECISIONS:
        raise UnsupportedError(f"qmatmul precision {precision!r} is not one of {sorted(PRECISIONS)}")
    T_in = tile_expert.shape[0]
    if tile_rows.shape != (T_in, cfg.BM):
        raise UnsupportedError(f"tile_rows {tile_rows.shape} must be [{T_in}, {cfg.BM}]")
    tile_expert = tile_expert.astype(jnp.int32)
    tile_rows = tile_rows.astype(jnp.int32)
    if interpret and T_in < 2:  # keep the interpreter's grid loop (see gemv.grouped_gemv)
        tile_expert = jnp.concatenate([tile_expert, jnp.full((1,), -1, jnp.int32)])
        tile_rows = jnp.concatenate([tile_rows, tile_rows[:1]])
    T = tile_expert.shape[0]
    n_groups = k_in // P.GROUP
    n_tiles = -(-n_out // cfg.BN)
    sp = split_k(n_groups, n_tiles, 1, cfg.target_programs)
    names = D.TABLES.get(qtype, ())
    tabs = [jnp.asarray(D.table(n)) for n in names]
    n_pad = n_tiles * cfg.BN
    full = pl.no_block_spec
    call = dispatch.pallas_call(
        functools.partial(_kernel, qtype=qtype, n_out=n_out, k_in=k_in, BN=cfg.BN, BM=cfg.BM, cps=sp["cps"],
                          n_groups=n_groups, masked=sp["masked"], x_pieces=PRECISIONS[precision],
                          table_names=names),
        out_shape=[jax.ShapeDtypeStruct((T, sp["split"], n_pad, cfg.BM), jnp.float32)],
        grid=(n_tiles, sp["split"], T), in_specs=[full] * (4 + len(tabs)), out_specs=[full],
        interpret=interpret, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        name=f"qmatmul_tc_{getattr(qtype, 'name', qtype)}")
    (part,) = call(tile_expert, tile_rows, w_stacked.reshape(-1), x.reshape(-1), *tabs)
    out = part[:, 0]
    for j in range(1, sp["split"]):  # fixed order
        out = out + part[:, j]
    return jnp.swapaxes(out[:T_in, :n_out], 1, 2)


def gemm(x, w, qtype, n_out: int, k_in: int, *, interpret: bool, precision: str = DEFAULT_PRECISION,
         cfg: Config = PREFILL):
    """x [M, K] times one weight [n_out, K]^T -> float32 [M, n_out], rows in tiles of ``cfg.BM`` (any M; the
    tensor-core GEMV is ``cfg=GEMV_TC``). Not jitted."""
    M = x.shape[0]
    T = -(-M // cfg.BM)
    rows = jnp.minimum(jnp.arange(T * cfg.BM, dtype=jnp.int32), M - 1).reshape(T, cfg.BM)
    y = tile_gemm(x, w[None], jnp.zeros((T,), jnp.int32), rows, qtype, n_out, k_in, interpret=interpret,
                  precision=precision, cfg=cfg)
    return y.reshape(T * cfg.BM, n_out)[:M]
