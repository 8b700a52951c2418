"""Pallas GEMV/GEMM against a GGUF-quantized weight, decoding the blocks in registers.

Grid: (output-row tiles of BN rows, K splits, slots). A program owns BN weight rows of one matrix (its slot's) and
one contiguous range of K; it walks that range in chunks of S sub-blocks x W values -- a loop with a trip count
fixed at compile time (every split runs the same number of chunks; a ragged last split is masked, never shortened)
-- gathering the chunk's bytes (each weight byte is read from memory once per slot, whatever M is), decoding them
to float32 with `formats.FORMATS[qtype].decode`, and accumulating into float32 (`Config.mode` selects how). At the
end each row's accumulator is written to ``partial[slot, split, rows, m]``; the wrapper sums the splits in a fixed
order. Every activation row runs the same instructions on the same weight tile, and rows never mix, so row m of an
M-row call equals the row computed alone (M = 1), bit for bit: the reduction order of output (m, n) depends only on
K and constants chosen from the weight (`tiling`), never on M.

Two launch shapes share this body:

* the GEMV (`Config.mode` "reduce" / "elementwise"): 1..8 activation rows, unrolled in the kernel (verify windows
  and decode steps; more than 8 rows of a window run as 8-row groups, one slot each, `qmatmul_kernel`);
* the GEMM (mode "dot", `GEMM_CONFIG`): 16-row groups (one slot each), one [BN, S*W] x [S*W, 16] float32 matrix
  product per chunk (TF32x3 on tensor cores when compiled: ~fp32 accuracy; HIGHEST in interpret mode), for prefill
  chunks. A row's bits do not depend on the other rows of its group nor on the number of groups, but differ from
  the GEMV's (another summation order).

Layouts: raw weights are passed flat (uint8 [n_mats * n_out * row_bytes], or float [n_mats * n_out * K] for
F32/F16/BF16), x as [U, M, K // W, W] (GEMV) or [U, M, K] (GEMM). Tile sizes depend on (qtype, n_out, K) only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from strata_jax.pallas import dispatch
from strata_jax.pallas.quant_matmul.formats import FLOAT_TYPES, FORMATS
from strata_jax.pallas.quant_matmul.gemv import split_step, tile_rows

M_MAX = 8         # the GEMV serves 1..8 activation rows (verify windows); more rows run as 8-row groups or the GEMM


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters. Chosen from (qtype, n_out, K) only -- never from M -- so rows stay independent."""
    BN: int = 16               # weight rows per program
    chunk: int = 256           # values per loop step (S * W), reduced to fit K
    target_programs: int = 264 # split K until the grid has at least this many programs
    num_warps: int = 4
    num_stages: int = 2
    # "reduce": per row, sum_W(w*x) into a [BN, S] accumulator every step; "elementwise": per row, accumulate w*x
    # in [BN, S, W] and reduce once at the end; "dot": rows padded to 16, one [BN, chunk] x [chunk, 16] matrix
    # product per step (TF32x3 on tensor cores when compiled: ~fp32 accuracy; HIGHEST in interpret mode).
    mode: str = "reduce"


DEFAULT = Config()


def sub_width(qtype, k_in: int | None = None) -> int:
    """Values per sub-block: the format's (32 or 16); for F32/F16/BF16 32, or the largest power of two dividing K
    when K is not a multiple of 32 (e.g. the K = 8 hyper-connection up projection of the tiny qwen4exp)."""
    if qtype in FORMATS:
        return FORMATS[qtype].W
    if k_in is None or k_in % 32 == 0:
        return 32
    return k_in & -k_in


def tiling(qtype, n_out: int, k_in: int, cfg: Config = DEFAULT) -> dict:
    """Tile sizes for a weight (never depend on M). ``cps`` chunks per split is a compile-time trip count: a
    divisor of the chunk count near the target is preferred (no masking); otherwise ``masked`` is set and the last
    split's chunks past the end are read clamped and contribute nothing."""
    W = sub_width(qtype, k_in)
    n_sub = k_in // W
    S = max(1, cfg.chunk // W)
    while S > 1 and n_sub % S:
        S //= 2
    n_chunks = n_sub // S
    n_tiles = -(-n_out // cfg.BN)
    split = max(1, min(n_chunks, -(-cfg.target_programs // n_tiles)))
    cps0 = -(-n_chunks // split)        # chunks per split
    cps = next((c for c in range(cps0, min(2 * cps0, n_chunks) + 1) if n_chunks % c == 0), cps0)
    split = -(-n_chunks // cps)         # no empty splits
    return dict(W=W, S=S, n_chunks=n_chunks, n_tiles=n_tiles, split=split, cps=cps,
                masked=split * cps != n_chunks)


# Chosen on an H200 (jax 0.11.2) by ``experiments/bench_kernels.py --only sweep_qmatmul`` on 8192 x 28672
# weights, minimising the summed time of M = 1, 4 and 8 rows: K-quants prefer the per-step reduction with 16-row
# tiles, the 32-value block formats the elementwise accumulation with 8-row tiles (M = 8 twice as fast as 16 rows).
K_QUANT_CONFIG = Config(BN=16, chunk=256, num_warps=4, target_programs=2112, mode="reduce")
BLOCK32_CONFIG = Config(BN=8, chunk=256, num_warps=4, target_programs=2112, mode="elementwise")
# The prefill GEMM (prefill rows at any M, or more than 8 rows without row groups): 16-row groups, one float32 matrix product per chunk.
# A first, simple choice (not tuned: the speed of prefill is the next issue's).
GEMM_CONFIG = Config(BN=32, chunk=128, num_warps=4, target_programs=264, mode="dot")


def choose_config(qtype, n_out: int, k_in: int) -> Config:
    """The launch parameters for a weight (a function of the weight only, never of M)."""
    if qtype in FORMATS and FORMATS[qtype].QB == 256:
        return K_QUANT_CONFIG
    return BLOCK32_CONFIG


def why_not(qtype, M: int, n_out: int, k_in: int, x_dtype, w_dtype, n_mats: int = 1,
            row_groups: bool = False) -> str | None:
    """None when the kernel serves M rows of this weight, else the reason. Any M: 1..8 rows run the GEMV, more
    rows the GEMV in 8-row groups (``row_groups``: verify windows, the moe kernel) or the 16-row GEMM."""
    if qtype not in FORMATS and qtype not in FLOAT_TYPES:
        return f"block format {getattr(qtype, 'name', qtype)} has no Pallas kernel yet"
    if M < 1:
        return f"M={M} rows"
    W = sub_width(qtype, k_in)
    if k_in % W:
        return f"K={k_in} is not a multiple of {W}"
    nbytes = n_out * k_in * (jnp.dtype(w_dtype).itemsize if qtype in FLOAT_TYPES else 1)
    if qtype in FORMATS:
        f = FORMATS[qtype]
        nbytes = n_out * (k_in // f.QB) * f.BPB
    nbytes *= n_mats
    if nbytes >= 2**31:
        return f"weight of {nbytes} bytes (int32 offsets)"
    if jnp.dtype(x_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"activation dtype {jnp.dtype(x_dtype).name}"
    return None


MP_DOT = 16  # rows of the activation tile in "dot" mode (Triton's smallest dot dimension)


def gemm_serves(qtype, n_out: int, k_in: int) -> bool:
    """Whether the 16-row GEMM serves this weight: its chunk must be a Triton dot of K >= 16 (not so for a tiny
    K such as the K = 8 hyper-connection up projection, whose prefill rows then run as 8-row GEMV groups)."""
    t = tiling(qtype, n_out, k_in, GEMM_CONFIG)
    return t["S"] * t["W"] >= 16


def _kernel(slot_ref, raw_ref, x_ref, o_ref, *, qtype, M, n_out, k_in, row_bytes, W, S, n_chunks, cps, masked,
            BN, mode, x_per_slot, interpret):
    i = pl.program_id(0)
    s = pl.program_id(1)
    u = pl.program_id(2)
    e = slot_ref[u]            # which stacked matrix this program reads (-1: an unused slot, skipped)
    xu = u if x_per_slot else 0

    @pl.when(e >= 0)
    def _():
        rows = tile_rows(i, e, BN, n_out, 3)
        sub_local = lax.broadcasted_iota(jnp.int32, (1, S, 1), 1)
        lane = lax.broadcasted_iota(jnp.int32, (1, 1, W), 2)

        def body(j, accs):
            c, live = split_step(s, j, cps, n_chunks, masked)
            keep = (lambda d: jnp.where(live, d, 0.0)) if masked else (lambda d: d)
            sub = c * S + sub_local
            if qtype in FLOAT_TYPES:
                w = raw_ref[rows * k_in + sub * W + lane].astype(jnp.float32)
            else:
                f = FORMATS[qtype]
                base = rows * row_bytes + (sub * W // f.QB) * f.BPB
                e0 = (sub * W) % f.QB
                w = f.decode(lambda off: raw_ref[base + off].astype(jnp.uint32), e0, lane)
            if mode == "dot":
                xt = x_ref[xu, :, pl.ds(c * S * W, S * W)].astype(jnp.float32)           # [MP_DOT, S*W]
                prec = (lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
                return accs + keep(lax.dot_general(w.reshape(BN, S * W), xt, (((1,), (1,)), ((), ())),
                                                   precision=prec, preferred_element_type=jnp.float32))
            out = []
            for m in range(M):
                xm = x_ref[xu, m, pl.ds(c * S, S), :].astype(jnp.float32)
                out.append(accs[m] + keep(w * xm[None] if mode == "elementwise" else jnp.sum(w * xm[None], axis=2)))
            return tuple(out)

        # a compile-time trip count: the same loop for every program, and no while loop of unknown length in the
        # interpreter's program either
        if mode == "dot":
            acc = lax.fori_loop(0, cps, body, jnp.zeros((BN, MP_DOT), jnp.float32))
            o_ref[u, s, pl.ds(i * BN, BN), :] = acc
            return
        acc_shape = (BN, S, W) if mode == "elementwise" else (BN, S)
        accs = lax.fori_loop(0, cps, body, tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(M)))
        for m in range(M):
            acc = jnp.sum(accs[m], axis=2) if mode == "elementwise" else accs[m]
            o_ref[u, s, pl.ds(i * BN, BN), m] = jnp.sum(acc, axis=1)


def grouped_qmatmul_kernel(x, w_stacked, slot_expert, qtype, n_out: int, k_in: int, *, interpret: bool,
                           cfg: Config | None = None):
    """For each slot u: x (or x[u]) [M, K] times the decoded matrix ``w_stacked[slot_expert[u]]`` [n_out, K]^T.

    Args:
      x: [M, K] (the same rows for every slot) or [U, M, K] (rows per slot); M <= 8 (M <= 16 in "dot" mode);
        float32/bfloat16/float16.
      w_stacked: [E, n_out, row_bytes] uint8 (or [E, n_out, K] float for F32/F16/BF16).
      slot_expert: int32 [U]: the matrix each slot reads, or -1 for an unused slot (its output is not written).
    Returns: float32 [U, M, n_out]. Each matrix a slot names is read once; rows never mix. Not jitted.
    """
    x_per_slot = x.ndim == 3
    U_in = slot_expert.shape[0]
    if interpret and U_in < 2:
        # Interpret mode inlines the grid loop into XLA, which folds a grid of one program into straight-line code
        # and rounds differently from the same program inside the loop (seen: a [6, 256] weight, 1 row alone vs in
        # 8-row groups): an idle second slot keeps the loop.
        slot_expert = jnp.concatenate([slot_expert.astype(jnp.int32), jnp.full((1,), -1, jnp.int32)])
        if x_per_slot:
            x = jnp.concatenate([x, x[:1]])
    U = slot_expert.shape[0]
    M_in = x.shape[-2]
    cfg = cfg or choose_config(qtype, n_out, k_in)
    # "dot" mode always runs MP_DOT rows. Interpret mode hands the kernel body to XLA, which fuses the M per-row
    # reductions differently for different M; with the rows padded to M_MAX every M runs the very same program.
    # (Compiled Triton code computes each row with the same instructions for any M, tested on the GPU.)
    m_run = MP_DOT if cfg.mode == "dot" else (M_MAX if interpret else M_in)
    if M_in < m_run:
        pad = [(0, 0)] * x.ndim
        pad[-2] = (0, m_run - M_in)
        x = jnp.pad(x, pad)
    M = x.shape[-2]
    BN = cfg.BN
    t = tiling(qtype, n_out, k_in, cfg)
    W, S = t["W"], t["S"]
    row_bytes = w_stacked.shape[-1] if qtype in FORMATS else k_in
    n_pad = t["n_tiles"] * BN
    full = pl.no_block_spec
    call = dispatch.pallas_call(
        functools.partial(_kernel, qtype=qtype, M=M, n_out=n_out, k_in=k_in, row_bytes=row_bytes, W=W, S=S,
                          n_chunks=t["n_chunks"], cps=t["cps"], masked=t["masked"], BN=BN, mode=cfg.mode,
                          x_per_slot=x_per_slot,
                          interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct((U, t["split"], n_pad, M), jnp.float32)],
        grid=(t["n_tiles"], t["split"], U), in_specs=[full, full, full], out_specs=[full], interpret=interpret,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, name=f"qmatmul_{getattr(qtype, 'name', qtype)}")
    U_x = x.shape[0] if x_per_slot else 1
    xr = x.reshape(U_x, M, k_in) if cfg.mode == "dot" else x.reshape(U_x, M, k_in // W, W)
    (part,) = call(slot_expert.astype(jnp.int32), w_stacked.reshape(-1), xr)
    out = part[:, 0]
    for j in range(1, t["split"]):  # fixed order: row-independent
        out = out + part[:, j]
    return jnp.swapaxes(out[:U_in, :n_out, :M_in], 1, 2)


def qmatmul_kernel(x, w_raw, qtype, n_out: int, k_in: int, *, interpret: bool, cfg: Config | None = None,
                   gemm: bool = False):
    """x [M, K] times the decoded weight [n_out, K] transposed -> float32 [M, n_out]. Not jitted.

    M <= 8 (and not ``gemm``): one GEMV. M > 8 (the row groups of `strata_jax.pallas.quant_matmul.qmatmul`): the
    rows are cut into groups of 8 (the last one zero-padded), run in one launch as the slots of
    `grouped_qmatmul_kernel` (every slot reads the same matrix, so the weight is read once per group); each row gets
    the instructions of an 8-row GEMV, which are those of the row alone. ``gemm``: the 16-row GEMM (`GEMM_CONFIG`,
    prefill chunks) for any M; its bits differ from the GEMV's."""
    M = x.shape[0]
    w1 = w_raw[None]
    if gemm:
        G = -(-M // MP_DOT)
        xg = jnp.pad(x, [(0, G * MP_DOT - M), (0, 0)]).reshape(G, MP_DOT, k_in)
        y = grouped_qmatmul_kernel(xg, w1, jnp.zeros((G,), jnp.int32), qtype, n_out, k_in, interpret=interpret,
                                   cfg=cfg or GEMM_CONFIG)                         # [G, 16, n_out]
        return y.reshape(G * MP_DOT, n_out)[:M]
    if M <= M_MAX:
        return grouped_qmatmul_kernel(x, w1, jnp.zeros((1,), jnp.int32), qtype, n_out, k_in,
                                      interpret=interpret, cfg=cfg)[0]
    G = -(-M // M_MAX)
    xg = jnp.pad(x, [(0, G * M_MAX - M), (0, 0)]).reshape(G, M_MAX, k_in)
    y = grouped_qmatmul_kernel(xg, w1, jnp.zeros((G,), jnp.int32), qtype, n_out, k_in,
                               interpret=interpret, cfg=cfg)                       # [G, 8, n_out]
    return y.reshape(G * M_MAX, n_out)[:M]
