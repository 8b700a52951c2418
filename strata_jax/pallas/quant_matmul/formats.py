"""GGUF block formats written as per-element byte gathers, for decoding inside a Pallas kernel.

Source: ggml's block structs (``ggml/src/ggml-common.h``: block_q4_0 ... block_q6_K) and ``dequantize_row_*`` in
``ggml/src/ggml-quants.c``; the arithmetic follows `strata_jax.gguf.blocks` (itself bit-identical to gguf-py).

A kernel decodes a tile of one or more rows by *sub-blocks* of ``W`` consecutive values (W = 32, or 16 for the
formats whose scales cover 16 values). Each `Format.decode` is written elementwise: it receives

* ``get(off)``: the bytes at block-relative byte offsets ``off`` (an int32 array broadcastable against the tile's
  sub-block grid) as uint32, gathered for every row of the tile -- a Pallas ref gather in the kernel, a jnp gather
  in the tests;
* ``e0`` int32 [1, S, 1]: the position of each sub-block's first value inside its ggml block (0 <= e0 < QB);
* ``l`` int32 [1, 1, W]: the lane (position inside the sub-block),

and returns float32 [R, S, W] values. Only shifts, masks, integer arithmetic, one bitcast for fp16 scales and
float32 multiplies are used, so the same code lowers through Triton and runs in interpret mode.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
from jax import lax
from gguf.constants import GGMLQuantizationType as Q


@dataclasses.dataclass(frozen=True)
class Format:
    qtype: Q
    QB: int    # values per ggml block
    BPB: int   # bytes per ggml block
    W: int     # sub-block width used by the kernel (a power of two dividing QB)
    decode: Callable


def _f16(get, off):
    """fp16 little-endian field at byte `off` -> float32 (exact: fp16 -> fp32 widening)."""
    bits = get(off) | (get(off + 1) << 8)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _i8(u):
    """uint32 byte values -> int32 two's complement int8."""
    return (u.astype(jnp.int32) ^ 128) - 128


def _f(x):
    return x.astype(jnp.float32)


def _q8_0(get, e0, l):
    d = _f16(get, 0 * e0)
    return _f(_i8(get(2 + l))) * d


def _q4_0(get, e0, l):
    d = _f16(get, 0 * e0)
    q = (get(2 + l % 16) >> ((l // 16) * 4)) & 0xF
    return d * _f(q.astype(jnp.int32) - 8)


def _q4_1(get, e0, l):
    d, m = _f16(get, 0 * e0), _f16(get, 0 * e0 + 2)
    q = (get(4 + l % 16) >> ((l // 16) * 4)) & 0xF
    return d * _f(q) + m


def _q5(get, l, qh_off, qs_off):
    lo = (get(qs_off + l % 16) >> ((l // 16) * 4)) & 0xF
    hi = (get(qh_off + l // 8) >> (l % 8)) & 1  # bit l of the little-endian uint32 qh
    return lo | (hi << 4)


def _q5_0(get, e0, l):
    d = _f16(get, 0 * e0)
    return d * _f(_q5(get, l, 2, 6).astype(jnp.int32) - 16)


def _q5_1(get, e0, l):
    d, m = _f16(get, 0 * e0), _f16(get, 0 * e0 + 2)
    return d * _f(_q5(get, l, 4, 8)) + m


def _scale_min_k4(get, j):
    """ggml get_scale_min_k4 for sub-block j (int32 array, 0..7); the 12 scale bytes start at byte 4."""
    jj = j % 4
    a = get(4 + jj)
    b = get(8 + jj)
    c = get(12 + jj)
    hi = j >= 4
    sc = jnp.where(hi, (c & 0xF) | ((a >> 2) & 0x30), a & 63)
    mn = jnp.where(hi, (c >> 4) | ((b >> 2) & 0x30), b & 63)
    return sc, mn


def _q4_k(get, e0, l):
    j = e0 // 32
    d, dmin = _f16(get, 0 * e0), _f16(get, 0 * e0 + 2)
    sc, mn = _scale_min_k4(get, j)
    dd, dm = d * _f(sc), dmin * _f(mn)
    q = (get(16 + (j // 2) * 32 + l) >> ((j % 2) * 4)) & 0xF
    return dd * _f(q) - dm


def _q5_k(get, e0, l):
    j = e0 // 32
    d, dmin = _f16(get, 0 * e0), _f16(get, 0 * e0 + 2)
    sc, mn = _scale_min_k4(get, j)
    dd, dm = d * _f(sc), dmin * _f(mn)
    ql = (get(48 + (j // 2) * 32 + l) >> ((j % 2) * 4)) & 0xF
    qh = (get(16 + l) >> j) & 1
    return dd * _f(ql | (qh << 4)) - dm


def _q6_k(get, e0, l):  # W = 16: one int8 scale per sub-block
    e = e0 + l
    n, r = e // 128, e % 128
    qd, ll = r // 32, r % 32
    ql = (get(n * 64 + (qd % 2) * 32 + ll) >> ((qd // 2) * 4)) & 0xF
    qh = (get(128 + n * 32 + ll) >> (qd * 2)) & 3
    q = (ql | (qh << 4)).astype(jnp.int32) - 32
    d = _f16(get, 0 * e0 + 208)
    dd = d * _f(_i8(get(192 + e0 // 16)))
    return dd * _f(q)


def _q2_k(get, e0, l):  # W = 16
    e = e0 + l
    n, r = e // 128, e % 128
    q = (get(16 + n * 32 + r % 32) >> ((r // 32) * 2)) & 3
    s = get(e0 // 16)
    d, dmin = _f16(get, 0 * e0 + 80), _f16(get, 0 * e0 + 82)
    dl, ml = d * _f(s & 0xF), dmin * _f(s >> 4)
    return dl * _f(q) - ml


def _q3_k(get, e0, l):  # W = 16
    e = e0 + l
    n, r = e // 128, e % 128
    ql = (get(32 + n * 32 + r % 32) >> ((r // 32) * 2)) & 3
    qh = (get(0 + e % 32) >> (e // 32)) & 1
    q = ql.astype(jnp.int32) - ((qh ^ 1) << 2).astype(jnp.int32)
    g = e0 // 16
    lsc = get(96 + g % 8) >> ((g // 8) * 4)
    hsc = get(104 + g % 4) >> ((g // 4) * 2)
    sc = ((lsc & 0x0F) | ((hsc & 0x03) << 4)).astype(jnp.int32) - 32
    d = _f16(get, 0 * e0 + 108)
    return (d * _f(sc)) * _f(q)


FORMATS: dict[Q, Format] = {f.qtype: f for f in [
    Format(Q.Q8_0, 32, 34, 32, _q8_0),
    Format(Q.Q4_0, 32, 18, 32, _q4_0),
    Format(Q.Q4_1, 32, 20, 32, _q4_1),
    Format(Q.Q5_0, 32, 22, 32, _q5_0),
    Format(Q.Q5_1, 32, 24, 32, _q5_1),
    Format(Q.Q2_K, 256, 84, 16, _q2_k),
    Format(Q.Q3_K, 256, 110, 16, _q3_k),
    Format(Q.Q4_K, 256, 144, 32, _q4_k),
    Format(Q.Q5_K, 256, 176, 32, _q5_k),
    Format(Q.Q6_K, 256, 210, 16, _q6_k),
]}

FLOAT_TYPES = {Q.F32: jnp.float32, Q.F16: jnp.float16, Q.BF16: jnp.bfloat16}


def decode_rows_jnp(raw, qtype, n_cols: int):
    """Decode uint8 [R, row_bytes] with `FORMATS[qtype]` using jnp gathers (tests the decoders without Pallas)."""
    f = FORMATS[Q(qtype)]
    R = raw.shape[0]
    nsub = n_cols // f.W
    flat = raw.reshape(-1)
    row_bytes = raw.shape[1]
    rows = jnp.arange(R, dtype=jnp.int32)[:, None, None]
    sub = jnp.arange(nsub, dtype=jnp.int32)[None, :, None]
    base = rows * row_bytes + (sub * f.W // f.QB) * f.BPB
    e0 = (sub * f.W) % f.QB
    l = jnp.arange(f.W, dtype=jnp.int32)[None, None, :]
    get = lambda off: flat[base + off].astype(jnp.uint32)
    return f.decode(get, e0, l).reshape(R, n_cols)
