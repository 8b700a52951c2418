"""GGUF block formats, dequantized in plain `jax.numpy`, bit-identical to the numpy oracle `gguf.quants.dequantize`.

Every weight of a GGUF file is stored as rows of fixed-size *blocks*; a block of a format holds ``values_per_block``
numbers in ``bytes_per_block`` bytes (`BLOCK`). The layouts are ggml's (``ggml/src/ggml-common.h`` structs
``block_q4_0`` ... ``block_iq4_xs``, decoded by ``dequantize_row_*`` in ``ggml/src/ggml-quants.c``); the arithmetic
here mirrors gguf-py's ``gguf/quants.py`` (``Q4_0.dequantize_blocks`` etc.) operation by operation, so the float32
results match ``gguf.quants.dequantize(raw, qtype)`` bit for bit (tests/test_blocks.py checks every format).

Why the results are exact under XLA (tested on CPU; the same argument covers GPU): every fp16 scale is widened
to float32 with integer bit operations (`_f16_bits_to_f32`), not with a float convert (XLA quiets signalling NaNs
where numpy keeps their payload), and every float product below has at most 24 significant bits (an 11-bit fp16
significand times small integer codes, scales and grid values), so it is exact in float32. Hence
the one rounding step per value (e.g. the subtraction in ``d * q - m``) is the same whether or not the compiler
fuses it into an FMA (XLA's CPU and GPU backends do), and no float32 subnormal ever appears (XLA's CPU backend
flushes them to zero). Both facts assume finite scales: a block whose fp16 scale is inf/NaN produces NaNs whose
sign/payload may differ from numpy's.

One deliberate difference from gguf-py: for IQ1_M, gguf 0.19's ``IQ1_M.dequantize_blocks`` tests the delta sign
with ``qh & 0x08 == 0``, which Python parses as ``qh & (0x08 == 0)``, so it always uses ``-delta``. This module
follows ggml's ``dequantize_row_iq1_m`` (``delta = qh & 0x08 ? -IQ1S_DELTA : IQ1S_DELTA`` per 8 values); it agrees
with gguf-py bit for bit wherever those bits are set.

Supported (`SUPPORTED`): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S, IQ1_M,
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS. Anything else (Q8_1, Q8_K, TQ1_0, TQ2_0, MXFP4, NVFP4,
Strata's repo-specific Q2_0 = type id 42, integer types, ...) raises `strata_jax.errors.UnsupportedError`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from gguf import quants as _gq
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

from strata_jax.errors import StrataError, UnsupportedError

Q = GGMLQuantizationType

__all__ = ["BLOCK", "SUPPORTED", "check_supported", "dequantize", "format_name", "row_bytes"]

# Block formats ggml defines but this module does not decode, keyed by type id, for error messages about ids that
# gguf's enum may not know.
_EXTRA_NAMES = {42: "Q2_0"}

SUPPORTED: frozenset[GGMLQuantizationType] = frozenset({
    Q.F32, Q.F16, Q.BF16,
    Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS,
})

#: ``{qtype: (values_per_block, bytes_per_block)}`` for every format in `SUPPORTED` (from gguf's GGML_QUANT_SIZES).
BLOCK: dict[GGMLQuantizationType, tuple[int, int]] = {t: tuple(GGML_QUANT_SIZES[t]) for t in SUPPORTED}


def format_name(qtype) -> str:
    """The ggml name of a block format given as a `GGMLQuantizationType` or a raw type id (e.g. 42 -> ``"Q2_0"``)."""
    if isinstance(qtype, GGMLQuantizationType):
        return qtype.name
    try:
        return GGMLQuantizationType(int(qtype)).name
    except (ValueError, TypeError):
        return _EXTRA_NAMES.get(qtype, f"type id {qtype}")


def _as_qtype(qtype, name: str | None) -> GGMLQuantizationType:
    """`qtype` as a supported enum member, or `UnsupportedError` naming the format (and tensor)."""
    if not isinstance(qtype, GGMLQuantizationType):
        try:
            qtype = GGMLQuantizationType(int(qtype))
        except (ValueError, TypeError):
            pass
    if qtype not in SUPPORTED:
        where = f" for tensor {name}" if name else ""
        raise UnsupportedError(f"unsupported block format {format_name(qtype)}{where}")
    return qtype


def check_supported(qtype, name: str | None = None) -> GGMLQuantizationType:
    """Check at load time that `dequantize` can decode `qtype`.

    Args:
      qtype: a `GGMLQuantizationType` or a raw ggml type id (int).
      name: the tensor name, used in the error message.

    Returns:
      the format as a `GGMLQuantizationType`.

    Raises:
      UnsupportedError: ``"unsupported block format Q8_1 for tensor blk.0.ffn_up.weight"`` for any format outside
        `SUPPORTED` (including ids gguf's enum does not know, such as Strata's Q2_0 = 42).
    """
    return _as_qtype(qtype, name)


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes of one row of `n_cols` values in format `qtype`.

    Raises:
      UnsupportedError: `qtype` is not in `SUPPORTED`.
      StrataError: `n_cols` is not a positive multiple of the format's block size.
    """
    qtype = _as_qtype(qtype, None)
    block, size = BLOCK[qtype]
    if n_cols <= 0 or n_cols % block:
        raise StrataError(f"a {qtype.name} row of {n_cols} values is not a whole number of {block}-value blocks")
    return n_cols // block * size


# ---------------------------------------------------------------------------------------------------------------
# bit helpers (all integer work is done in uint32/int32, so nothing overflows)

_U32 = jnp.uint32


def _u(x):
    return x.astype(_U32)


def _le(b, width: int):
    """Little-endian unsigned integers from bytes: uint8 [..., n*width] -> uint32 [..., n] (width 2 or 4)."""
    b = _u(b).reshape(*b.shape[:-1], b.shape[-1] // width, width)
    out = b[..., 0]
    for i in range(1, width):
        out = out | (b[..., i] << (8 * i))
    return out


def _shr(x, shifts):
    """``x[..., None, :] >> shifts`` : [..., n] -> [..., len(shifts), n] (numpy's ``reshape(.., 1, n) >> s``)."""
    return x[..., None, :] >> jnp.asarray(shifts, _U32)[:, None]


def _shr_last(x, shifts):
    """``x[..., :, None] >> shifts`` : [..., n] -> [..., n, len(shifts)]."""
    return x[..., :, None] >> jnp.asarray(shifts, _U32)


def _bitcast_f32(bits):
    return jax.lax.bitcast_convert_type(bits.astype(_U32), jnp.float32)


def _f16_bits_to_f32(h):
    """IEEE half bits (any unsigned int dtype, values < 2**16) -> float32, exactly as numpy's float16->float32.

    Pure integer work: subnormal halves are normalised with a count-leading-zeros, and NaN payloads are kept (a
    float convert in XLA would quiet signalling NaNs; numpy keeps them).
    """
    h = _u(h)
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    normal = ((exp + 112) << 23) | (man << 13)
    infnan = jnp.uint32(0x7F800000) | (man << 13)
    # subnormal: value man * 2**-24 with the top set bit of man at position p -> exponent field 103 + p
    p = 31 - jax.lax.clz(man)
    sub = ((103 + p) << 23) | ((man << (23 - p)) & 0x7FFFFF)
    sub = jnp.where(man == 0, jnp.uint32(0), sub)
    bits = jnp.where(exp == 0, sub, jnp.where(exp == 31, infnan, normal))
    return _bitcast_f32(bits | sign)


def _f16(b):
    """fp16 field(s) from little-endian bytes: uint8 [..., 2*n] -> float32 [..., n]."""
    return _f16_bits_to_f32(_le(b, 2))


def _f32(x):
    return x.astype(jnp.float32)


def _signs(bits):
    """0/1 sign bits -> float32 +1/-1 (gguf-py's ``np.where(signs == 0, 1, -1)``)."""
    return jnp.where(bits == 0, jnp.float32(1), jnp.float32(-1))


def _nibbles(qs):
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high nibbles."""
    return (_shr(_u(qs), [0, 4]) & 0x0F).reshape(*qs.shape[:-1], 2 * qs.shape[-1])


@functools.lru_cache(maxsize=None)
def _grid(cls_name: str) -> np.ndarray:
    """The decoded IQ grid of gguf-py's class `cls_name` as float32 [entries, values_per_entry]."""
    cls = getattr(_gq, cls_name)
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)


@functools.lru_cache(maxsize=None)
def _ksigns() -> np.ndarray:
    return np.frombuffer(_gq.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.uint32)


_KVALUES_IQ4 = np.asarray(_gq.IQ4_NL.kvalues, dtype=np.int32)
_IQ1_DELTA = np.float32(_gq.IQ1_S.delta)


def _take(table, idx):
    return jnp.take(jnp.asarray(table), idx.astype(jnp.int32), axis=0, mode="clip")


# ---------------------------------------------------------------------------------------------------------------
# one function per format: uint8 blocks [..., nb, bytes_per_block] -> float32 [..., nb, values_per_block]

def _q4_0(b):
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 2:18]).astype(jnp.int32) - 8
    return d * _f32(q)


def _q4_1(b):
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _f32(_nibbles(b[..., 4:20]))
    return (d * q) + m


def _q5_bits(qh_bytes, qs):
    qh = _shr_last(_le(qh_bytes, 4)[..., 0:1], list(range(32)))[..., 0, :] & 1   # [..., 32]
    return _nibbles(qs) | (qh << 4)


def _q5_0(b):
    d = _f16(b[..., 0:2])
    q = _q5_bits(b[..., 2:6], b[..., 6:22]).astype(jnp.int32) - 16
    return d * _f32(q)


def _q5_1(b):
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _f32(_q5_bits(b[..., 4:8], b[..., 8:24]))
    return (d * q) + m


def _q8_0(b):
    d = _f16(b[..., 0:2])
    x = jax.lax.bitcast_convert_type(b[..., 2:34].astype(jnp.uint8), jnp.int8)
    return _f32(x) * d


def _q2_k(b):
    lead = b.shape[:-1]
    scales, qs = _u(b[..., 0:16]), _u(b[..., 16:80])
    d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
    dl = (d * _f32(scales & 0xF))[..., None]                      # [..., 16, 1]
    ml = (dmin * _f32(scales >> 4))[..., None]
    q = (_shr(qs.reshape(*lead, 2, 32), [0, 2, 4, 6]) & 3)        # [..., 2, 4, 32]
    q = _f32(q.reshape(*lead, 16, 16))
    return (dl * q - ml).reshape(*lead, QK_K)


def _q3_k(b):
    lead = b.shape[:-1]
    hmask, qs, scales = _u(b[..., 0:32]), _u(b[..., 32:96]), _u(b[..., 96:108])
    d = _f16(b[..., 108:110])
    lsc = _shr(scales[..., 0:8], [0, 4]).reshape(*lead, 16)
    hsc = _shr(scales[..., 8:12], [0, 2, 4, 6]).reshape(*lead, 16)
    sc = ((lsc & 0x0F) | ((hsc & 0x03) << 4)).astype(jnp.int32) - 32
    dl = (d * _f32(sc))[..., None]                                # [..., 16, 1]
    ql = _shr(qs.reshape(*lead, 2, 32), [0, 2, 4, 6]).reshape(*lead, 16, 16) & 3
    qh = _shr(hmask, list(range(8))).reshape(*lead, 16, 16) & 1
    qh = qh ^ 1  # the offset is zero when the hmask bit is set
    q = _f32(ql.astype(jnp.int32) - (qh << 2).astype(jnp.int32))
    return (dl * q).reshape(*lead, QK_K)


def _scale_min_k4(scales):
    """ggml's get_scale_min_k4 for all 8 sub-blocks: 12 bytes [..., 12] -> (sc, m) each uint32 [..., 8]."""
    s = _u(scales).reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(b):
    lead = b.shape[:-1]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _scale_min_k4(b[..., 4:16])
    dd = (d * _f32(sc))[..., None]                                # [..., 8, 1]
    dm = (dmin * _f32(mn))[..., None]
    q = _shr(_u(b[..., 16:144]).reshape(*lead, 4, 32), [0, 4]) & 0x0F   # [..., 4, 2, 32]
    q = _f32(q.reshape(*lead, 8, 32))
    return (dd * q - dm).reshape(*lead, QK_K)


def _q5_k(b):
    lead = b.shape[:-1]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _scale_min_k4(b[..., 4:16])
    dd = (d * _f32(sc))[..., None]
    dm = (dmin * _f32(mn))[..., None]
    ql = (_shr(_u(b[..., 48:176]).reshape(*lead, 4, 32), [0, 4]) & 0x0F).reshape(*lead, 8, 32)
    qh = (_shr(_u(b[..., 16:48]), list(range(8))) & 1).reshape(*lead, 8, 32)
    q = _f32(ql | (qh << 4))
    return (dd * q - dm).reshape(*lead, QK_K)


def _q6_k(b):
    lead = b.shape[:-1]
    ql, qh = _u(b[..., 0:128]), _u(b[..., 128:192])
    scales = jax.lax.bitcast_convert_type(b[..., 192:208].astype(jnp.uint8), jnp.int8)
    d = _f16(b[..., 208:210])
    dd = (d * _f32(scales))[..., None]                            # [..., 16, 1]
    ql = (_shr(ql.reshape(*lead, 2, 64), [0, 4]) & 0x0F).reshape(*lead, 8, 32)
    qh = (_shr(qh.reshape(*lead, 2, 32), [0, 2, 4, 6]) & 0x03).reshape(*lead, 8, 32)
    q = (ql | (qh << 4)).astype(jnp.int32) - 32
    q = _f32(q.reshape(*lead, 16, 16))
    return (dd * q).reshape(*lead, QK_K)


def _iq2_xxs(b):
    lead = b.shape[:-1]
    d = _f16(b[..., 0:2])
    qs = _u(b[..., 2:66]).reshape(*lead, 8, 2, 4)
    aux = _le(qs[..., 1, :], 4)[..., 0]                            # [..., 8] sign/scale words
    db = d * (jnp.float32(0.5) + _f32(aux >> 28)) * jnp.float32(0.25)
    db = db[..., None, None]                                      # [..., 8, 1, 1]
    sidx = _shr_last(aux, [0, 7, 14, 21]) & 0x7F                  # [..., 8, 4]
    signs = _shr_last(_take(_ksigns(), sidx), list(range(8))) & 1  # [..., 8, 4, 8]
    grid = _take(_grid("IQ2_XXS"), qs[..., 0, :])                 # [..., 8, 4, 8]
    return (db * grid * _signs(signs)).reshape(*lead, QK_K)


def _iq2_db(d, scale_bytes):
    s = (_shr_last(_u(scale_bytes), [0, 4]) & 0x0F).reshape(*scale_bytes.shape[:-1], -1)  # [..., 16]
    return (d * (jnp.float32(0.5) + _f32(s)) * jnp.float32(0.25))[..., None, None]


def _iq2_xs(b):
    lead = b.shape[:-1]
    d = _f16(b[..., 0:2])
    qs = _le(b[..., 2:66], 2)                                     # [..., 32]
    db = _iq2_db(d, b[..., 66:74])                                # [..., 16, 1, 1]
    signs = _shr_last(_take(_ksigns(), qs >> 9), list(range(8))) & 1   # [..., 32, 8]
    signs = _signs(signs).reshape(*lead, 16, 2, 8)
    grid = _take(_grid("IQ2_XS"), qs & 511).reshape(*lead, 16, 2, 8)
    return (db * grid * signs).reshape(*lead, QK_K)


def _iq2_s(b):
    lead = b.shape[:-1]
    d = _f16(b[..., 0:2])
    qs, sbytes, qh = _u(b[..., 2:34]), _u(b[..., 34:66]), _u(b[..., 66:74])
    db = _iq2_db(d, b[..., 74:82])
    signs = _signs(_shr_last(sbytes, list(range(8))) & 1).reshape(*lead, 16, 2, 8)
    qh = (_shr_last(qh, [0, 2, 4, 6]) & 0x03).reshape(*lead, 32)
    idx = qs | (qh << 8)
    grid = _take(_grid("IQ2_S"), idx).reshape(*lead, 16, 2, 8)
    return (db * grid * signs).reshape(*lead, QK_K)


def _iq3_xxs(b):
    lead = b.shape[:-1]
    d = _f16(b[..., 0:2])
    qs = _u(b[..., 2:66])
    aux = _le(b[..., 66:98], 4)                                   # [..., 8]
    db = (d * (jnp.float32(0.5) + _f32(aux >> 28)) * jnp.float32(0.5))[..., None, None]
    sidx = _shr_last(aux, [0, 7, 14, 21]) & 0x7F
    signs = _shr_last(_take(_ksigns(), sidx), list(range(8))) & 1  # [..., 8, 4, 8]
    grid = _take(_grid("IQ3_XXS"), qs).reshape(*lead, 8, 4, 8)
    return (db * grid * _signs(signs)).reshape(*lead, QK_K)


def _iq3_s(b):
    lead = b.shape[:-1]
    d = _f16(b[..., 0:2])
    qs, qh, sbytes, scales = _u(b[..., 2:66]), _u(b[..., 66:74]), _u(b[..., 74:106]), _u(b[..., 106:110])
    s = (_shr_last(scales, [0, 4]) & 0x0F).reshape(*lead, 8)
    db = (d * _f32(1 + 2 * s))[..., None, None]                   # [..., 8, 1, 1]
    signs = _signs(_shr_last(sbytes, list(range(8))) & 1).reshape(*lead, 8, 4, 8)
    qh = (_shr_last(qh, list(range(8))) & 1).reshape(*lead, 64)
    idx = qs | (qh << 8)
    grid = _take(_grid("IQ3_S"), idx).reshape(*lead, 8, 4, 8)
    return (db * grid * signs).reshape(*lead, QK_K)


def _iq1_s(b):
    lead = b.shape[:-1]
    d = _f16(b[..., 0:2])
    qs = _u(b[..., 2:34])
    qh = _le(b[..., 34:50], 2)                                    # [..., 8]
    dl = (d * _f32(2 * ((qh >> 12) & 7) + 1))[..., None, None]    # [..., 8, 1, 1]
    delta = jnp.where((qh & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA)[..., None, None]
    idx = qs | ((_shr_last(qh, [0, 3, 6, 9]) & 7) << 8).reshape(*lead, 32)
    grid = _take(_grid("IQ1_S"), idx).reshape(*lead, 8, 4, 8)
    return (dl * (grid + delta)).reshape(*lead, QK_K)


def _iq1_m(b):
    lead = b.shape[:-1]
    qs, qh = _u(b[..., 0:32]), _u(b[..., 32:48])
    sc = _le(b[..., 48:56], 2)                                    # [..., 4]
    # the fp16 super-block scale is scattered over the top nibbles of the four scale words
    dbits = (sc & 0xF000) >> jnp.asarray([12, 8, 4, 0], _U32)
    d = _f16_bits_to_f32(dbits[..., 0] | dbits[..., 1] | dbits[..., 2] | dbits[..., 3])[..., None]  # [..., 1]
    s = (_shr_last(sc, [0, 3, 6, 9]) & 0x07).reshape(*lead, 16)
    dl = (d * _f32(2 * s + 1)).reshape(*lead, 8, 2, 1, 1)
    qh2 = _shr_last(qh, [0, 4])                                   # [..., 16, 2]
    idx = qs | ((qh2 & 0x07) << 8).reshape(*lead, 32)
    # ggml: delta = qh & 0x08 ? -IQ1S_DELTA : IQ1S_DELTA (gguf-py 0.19 always takes -delta; see module docstring)
    delta = jnp.where((qh2 & 0x08) == 0, _IQ1_DELTA, -_IQ1_DELTA).reshape(*lead, 8, 2, 2, 1)
    grid = _take(_grid("IQ1_M"), idx).reshape(*lead, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(*lead, QK_K)


def _iq4_nl(b):
    d = _f16(b[..., 0:2])
    q = _take(_KVALUES_IQ4, _nibbles(b[..., 2:18]))
    return d * _f32(q)


def _iq4_xs(b):
    lead = b.shape[:-1]
    d = _f16(b[..., 0:2])
    sh = _le(b[..., 2:4], 2)                                      # [..., 1]
    sl = (_shr_last(_u(b[..., 4:8]), [0, 4]) & 0x0F).reshape(*lead, 8)
    sh = (sh >> jnp.asarray([2 * i for i in range(8)], _U32)) & 0x03   # [..., 8]
    scales = (sl | (sh << 4)).astype(jnp.int32) - 32
    dl = (d * _f32(scales))[..., None]                            # [..., 8, 1]
    q = (_shr(_u(b[..., 8:136]).reshape(*lead, 8, 16), [0, 4]) & 0x0F).reshape(*lead, 8, 32)
    q = _f32(_take(_KVALUES_IQ4, q))
    return (dl * q).reshape(*lead, QK_K)


_DECODERS = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ2_XXS: _iq2_xxs, Q.IQ2_XS: _iq2_xs, Q.IQ2_S: _iq2_s, Q.IQ3_XXS: _iq3_xxs, Q.IQ3_S: _iq3_s,
    Q.IQ1_S: _iq1_s, Q.IQ1_M: _iq1_m, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs,
}
assert set(_DECODERS) | {Q.F32, Q.F16, Q.BF16} == SUPPORTED

_FLOAT_DTYPES = {Q.F32: jnp.float32, Q.F16: jnp.float16, Q.BF16: jnp.bfloat16}


def dequantize(raw, qtype, n_cols: int, name: str | None = None) -> jax.Array:
    """Decode rows of GGUF blocks to float32.

    Pure `jax.numpy` (jit-traceable with `qtype` and `n_cols` static); the result is bit-identical to
    ``gguf.quants.dequantize(np.asarray(raw), qtype)`` (see the module docstring for the IQ1_M exception).

    Args:
      raw: for a block format, uint8 [..., row_bytes(qtype, n_cols)] (jax or numpy, e.g. `GGUFFile.tensor_bytes`).
        For F32/F16/BF16 either those raw little-endian bytes (uint8 [..., n_cols * 4 or 2]) or an array already of
        dtype float32/float16/bfloat16 [..., n_cols].
      qtype: the block format (`GGMLQuantizationType` or its int id).
      n_cols: values per row (a multiple of the format's block size).
      name: tensor name for error messages.

    Returns:
      float32 [..., n_cols].

    Raises:
      UnsupportedError: `qtype` is not in `SUPPORTED` ("unsupported block format Q8_1 for tensor ...").
      StrataError: `n_cols` is not a whole number of blocks, or `raw` has the wrong dtype or last-axis size.
    """
    qtype = _as_qtype(qtype, name)
    nbytes = row_bytes(qtype, n_cols)
    raw = jnp.asarray(raw)
    what = f" of tensor {name}" if name else ""

    if qtype in _FLOAT_DTYPES and raw.dtype != jnp.uint8:
        if raw.dtype != _FLOAT_DTYPES[qtype] or raw.shape[-1:] != (n_cols,):
            raise StrataError(f"{qtype.name} data{what} must be uint8 [..., {nbytes}] or "
                              f"{jnp.dtype(_FLOAT_DTYPES[qtype]).name} [..., {n_cols}], got {raw.dtype} {raw.shape}")
        if qtype == Q.F32:
            return raw
        bits = jax.lax.bitcast_convert_type(raw, jnp.uint16)
        if qtype == Q.F16:
            return _f16_bits_to_f32(bits)
        return _bitcast_f32(_u(bits) << 16)

    if raw.dtype != jnp.uint8 or raw.ndim == 0 or raw.shape[-1] != nbytes:
        raise StrataError(f"{qtype.name} data{what} must be uint8 [..., {nbytes}] for {n_cols} values per row, "
                          f"got {raw.dtype} {raw.shape}")
    lead = raw.shape[:-1]
    if qtype == Q.F32:
        return _bitcast_f32(_le(raw, 4))
    if qtype == Q.F16:
        return _f16(raw)
    if qtype == Q.BF16:
        return _bitcast_f32(_le(raw, 2) << 16)
    block, size = BLOCK[qtype]
    blocks = raw.reshape(*lead, n_cols // block, size)
    return _DECODERS[qtype](blocks).reshape(*lead, n_cols)
