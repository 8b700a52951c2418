"""Pallas GEMV/GEMM for 1..8 rows against a GGUF-quantized weight, decoding the blocks in registers.

Grid: (output-row tiles of BN rows, K splits). A program owns BN weight rows and one contiguous range of K; it
walks that range in chunks of S sub-blocks x W values: it gathers the chunk's bytes (each weight byte is read from
memory once per call, whatever M is), decodes them to float32 with `formats.FORMATS[qtype].decode`, and for each of
the M activation rows accumulates ``sum_W(w * x)`` into a float32 [BN, S] accumulator. At the end each row's
accumulator is reduced over S and written to ``partial[split, m, rows]``; the wrapper sums the splits in a fixed
order. Every activation row runs the same instructions on the same weight tile, and rows never mix, so row m of
an M-row call equals the row computed alone (M = 1), bit for bit.

Layouts: raw weights are passed flat (uint8 [n_out * row_bytes], or float [n_out * K] for F32/F16/BF16), x as
[M, K // W, W]. Tile sizes depend on (qtype, n_out, K) only, never on M.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from strata_jax.pallas import dispatch
from strata_jax.pallas.quant_matmul.formats import FLOAT_TYPES, FORMATS

M_MAX = 8         # the kernel serves 1..8 activation rows (verify windows); more rows use the reference GEMM
BN = 16           # weight rows per program
CHUNK = 256       # values per chunk (S * W), reduced to fit K
TARGET_PROGRAMS = 264  # about two programs per H200 SM: split K until the grid has at least this many


def sub_width(qtype) -> int:
    return FORMATS[qtype].W if qtype in FORMATS else 32


def tiling(qtype, n_out: int, k_in: int) -> dict:
    """Tile sizes for a weight (never depend on M)."""
    W = sub_width(qtype)
    n_sub = k_in // W
    S = CHUNK // W
    while S > 1 and n_sub % S:
        S //= 2
    n_chunks = n_sub // S
    n_tiles = -(-n_out // BN)
    split = max(1, min(n_chunks, -(-TARGET_PROGRAMS // n_tiles)))
    cps = -(-n_chunks // split)        # chunks per split
    split = -(-n_chunks // cps)        # no empty splits
    return dict(W=W, S=S, n_chunks=n_chunks, n_tiles=n_tiles, split=split, cps=cps)


def why_not(qtype, M: int, n_out: int, k_in: int, x_dtype, w_dtype) -> str | None:
    if qtype not in FORMATS and qtype not in FLOAT_TYPES:
        return f"block format {getattr(qtype, 'name', qtype)} has no Pallas kernel yet"
    if not 1 <= M <= M_MAX:
        return f"M={M} rows (the kernel is a GEMV for 1..{M_MAX} rows; larger M uses the reference GEMM)"
    W = sub_width(qtype)
    if k_in % W:
        return f"K={k_in} is not a multiple of {W}"
    nbytes = n_out * k_in * (jnp.dtype(w_dtype).itemsize if qtype in FLOAT_TYPES else 1)
    if qtype in FORMATS:
        f = FORMATS[qtype]
        nbytes = n_out * (k_in // f.QB) * f.BPB
    if nbytes >= 2**31:
        return f"weight of {nbytes} bytes (int32 offsets)"
    if jnp.dtype(x_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"activation dtype {jnp.dtype(x_dtype).name}"
    return None


def _kernel(raw_ref, x_ref, o_ref, *, qtype, M, n_out, k_in, row_bytes, W, S, n_chunks, cps):
    i = pl.program_id(0)
    s = pl.program_id(1)
    rows = jnp.minimum(i * BN + lax.broadcasted_iota(jnp.int32, (BN, 1, 1), 0), n_out - 1)
    sub_local = lax.broadcasted_iota(jnp.int32, (1, S, 1), 1)
    lane = lax.broadcasted_iota(jnp.int32, (1, 1, W), 2)
    lo = s * cps
    hi = jnp.minimum(lo + cps, n_chunks)

    def body(c, accs):
        sub = c * S + sub_local
        if qtype in FLOAT_TYPES:
            w = raw_ref[rows * k_in + sub * W + lane].astype(jnp.float32)
        else:
            f = FORMATS[qtype]
            base = rows * row_bytes + (sub * W // f.QB) * f.BPB
            e0 = (sub * W) % f.QB
            w = f.decode(lambda off: raw_ref[base + off].astype(jnp.uint32), e0, lane)
        out = []
        for m in range(M):
            xm = x_ref[m, pl.ds(c * S, S), :].astype(jnp.float32)
            out.append(accs[m] + jnp.sum(w * xm[None], axis=2))
        return tuple(out)

    accs = lax.fori_loop(lo, hi, body, tuple(jnp.zeros((BN, S), jnp.float32) for _ in range(M)))
    for m in range(M):
        o_ref[s, m, pl.ds(i * BN, BN)] = jnp.sum(accs[m], axis=1)


def qmatmul_kernel(x, w_raw, qtype, n_out: int, k_in: int, *, interpret: bool):
    """x [M, K] (M <= 8) times the decoded weight [n_out, K] transposed -> float32 [M, n_out]. Not jitted."""
    M = x.shape[0]
    t = tiling(qtype, n_out, k_in)
    W, S = t["W"], t["S"]
    row_bytes = w_raw.shape[1] if qtype in FORMATS else k_in
    n_pad = t["n_tiles"] * BN
    full = pl.no_block_spec
    call = dispatch.pallas_call(
        functools.partial(_kernel, qtype=qtype, M=M, n_out=n_out, k_in=k_in, row_bytes=row_bytes, W=W, S=S,
                          n_chunks=t["n_chunks"], cps=t["cps"]),
        out_shape=[jax.ShapeDtypeStruct((t["split"], M, n_pad), jnp.float32)],
        grid=(t["n_tiles"], t["split"]), in_specs=[full, full], out_specs=[full], interpret=interpret,
        num_warps=4, num_stages=2, name=f"qmatmul_{getattr(qtype, 'name', qtype)}")
    (part,) = call(w_raw.reshape(-1), x.reshape(M, k_in // W, W))
    out = part[0]
    for j in range(1, t["split"]):  # fixed order: row-independent
        out = out + part[j]
    return out[:, :n_out]
