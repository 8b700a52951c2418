"""Decoders of the planar device format (`strata_jax.pallas.quant_matmul.planar`), shared by the Pallas kernels and
the jnp reference decoder.

Source: ggml's ``dequantize_row_*`` (``ggml/src/ggml-quants.c``) as mirrored by `strata_jax.gguf.blocks`; the
comments name the ggml fields.

A decoder sees a *tile*: rows x G groups of 32 consecutive values, each group laid out as ``VSHAPE[qtype]`` value
axes in natural order (e.g. (4, 8): value ``8a + j`` of the group). It reads words through a `Source` (a Pallas
ref gather inside a kernel; a jnp gather over a whole array in the reference) and returns `Codes`: per value an
unsigned integer code ``u`` with a static offset and optional sign bits, and per scale unit the float32 scale
``dl`` and offset ``mn``, so that

    weight = dl * (sign * (u - off)) + mn          (mn absent: 0)

equals `strata_jax.gguf.blocks.dequantize` of the same block bit for bit (every product is exact in float32, see
that module's docstring; IQ scales are rewritten with the same real value, e.g. ``d * (0.5 + s) * 0.25 ==
(d * (2s + 1)) * 0.125``, and IQ1's ``grid + delta`` as ``(8 grid +- 1) / 8``).

Codes become float32 without an int-to-float conversion (a slow instruction on GPUs): ``u < 2**23`` is OR-ed into
the mantissa of 2**23 and 2**23 + off subtracted, exactly (`code_f32`). Kernels keep ``dl`` out of the per-value
work: they sum ``code * x`` over a scale unit, then multiply once by ``dl`` (and add ``mn * sum x``).

Only shifts, masks, integer adds, popcount, gathers and float adds/multiplies are used, so a decoder lowers through
Pallas' Triton backend and runs in interpret mode.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from gguf import quants as _gq
from gguf.constants import GGMLQuantizationType as Q
from jax import lax

_MAGIC = 0x4B000000  # the bits of 2.0**23


class Codes(NamedTuple):
    """A decoded tile (see the module docstring). ``u`` uint32 broadcastable to [R, G, *vshape]; ``dl`` / ``mn``
    float32 broadcastable to it with size 1 on the value axes inside one scale unit; ``neg`` uint32 0/1 or None."""
    u: object
    off: int
    neg: object
    dl: object
    mn: object


class Source:
    """What a decoder reads. Subclasses set the rows and implement `words` and `table`.

    Attributes:
      grp: int32 [1, G, 1, ...]: the row-relative index of each group of the tile (group = 32 values).
      ax: per value axis i, int32 iota broadcastable along axis 2 + i.
      vshape: the value axes.
    """

    def __init__(self, grp, vshape):
        nd = 2 + len(vshape)
        self.vshape = tuple(vshape)
        self.grp = grp.reshape((1, -1) + (1,) * len(vshape))
        self.ax = []
        for i, n in enumerate(vshape):
            shape = [1] * nd
            shape[2 + i] = n
            self.ax.append(lax.broadcasted_iota(jnp.int32, tuple(shape), 2 + i))

    def words(self, region: str, idx):
        """uint32 words of ``region`` at row-relative word indices ``idx`` (int32), broadcast over the rows."""
        raise NotImplementedError

    def table(self, name: str, idx):
        """uint32 entries ``idx`` of the constant table ``name`` (`table`)."""
        raise NotImplementedError


def _u(x):
    return x.astype(jnp.uint32)


def plane(src: Source, region: str, bits: int):
    """The ``bits``-bit codes of a canonical plane for every value of the tile: uint32 [R, G, *vshape].

    The word of a value depends only on the leading value axes whose trailing product fits in one word, so the
    gather is issued on that smaller index shape (one load per word) and the shifts broadcast over the rest."""
    vs = src.vshape
    k = len(vs)
    while k > 0 and math.prod(vs[k - 1:]) * bits <= 32:
        k -= 1
    lead = 0
    trail = 0
    for i, ax in enumerate(src.ax):
        stride = math.prod(vs[i + 1:])
        if i < k:
            lead = lead + ax * stride
        else:
            trail = trail + ax * stride
    word = src.grp * bits + (lead * bits) // 32
    shift = (lead * bits) % 32 + trail * bits
    return (src.words(region, word) >> _u(shift)) & ((1 << bits) - 1)


def byte(src: Source, region: str, idx):
    """Byte ``idx`` (int32, row-relative) of a region, as uint32."""
    return (src.words(region, idx >> 2) >> _u((idx & 3) * 8)) & 0xFF


def half(src: Source, region: str, idx):
    """Little-endian 16-bit field ``idx`` (int32, row-relative, in units of 2 bytes) of a region, as uint32."""
    return (src.words(region, idx >> 1) >> _u((idx & 1) * 16)) & 0xFFFF


def f16(bits):
    """fp16 bits (uint32 < 2**16) -> float32 (exact)."""
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _f(x):
    return x.astype(jnp.float32)


def _ksign(sidx):
    """ggml's ksigns_iq2xs table: 7 stored sign bits plus an 8th making the count of negative signs even.

    The parity is an xor fold, not `lax.population_count`: Pallas' Triton lowering has no ``math.ctpop`` (the
    H200 run of 2026-12-02 failed to legalize it for IQ2_XXS / IQ2_XS / IQ3_XXS)."""
    p = sidx ^ (sidx >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return sidx | ((p & 1) << 7)


def code_f32(c: Codes):
    """float32 ``sign * (u - off)`` of a tile, exactly, with no int-to-float conversion."""
    f = lax.bitcast_convert_type(c.u | _MAGIC, jnp.float32) - jnp.float32(2 ** 23 + c.off)
    if c.neg is not None:
        f = lax.bitcast_convert_type(lax.bitcast_convert_type(f, jnp.uint32) ^ (c.neg << 31), jnp.float32)
    return f


def values(c: Codes):
    """float32 weights ``dl * code + mn`` of a tile (the dequantized values)."""
    w = c.dl * code_f32(c)
    return w if c.mn is None else w + c.mn


# --- 32-value block formats (Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL): region d / dm: per block fp16 d (and m) ---

def _q8_0(s):
    return Codes(plane(s, "q8", 8) ^ 0x80, 128, None, f16(half(s, "d", s.grp)), None)


def _q4_0(s):
    return Codes(plane(s, "q4", 4), 8, None, f16(half(s, "d", s.grp)), None)


def _q4_1(s):
    return Codes(plane(s, "q4", 4), 0, None, f16(half(s, "dm", 2 * s.grp)), f16(half(s, "dm", 2 * s.grp + 1)))


def _q5_0(s):
    u = plane(s, "q4", 4) | (plane(s, "q1", 1) << 4)
    return Codes(u, 16, None, f16(half(s, "d", s.grp)), None)


def _q5_1(s):
    u = plane(s, "q4", 4) | (plane(s, "q1", 1) << 4)
    return Codes(u, 0, None, f16(half(s, "dm", 2 * s.grp)), f16(half(s, "dm", 2 * s.grp + 1)))


def _iq4_nl(s):
    return Codes(s.table("iq4", plane(s, "q4", 4).astype(jnp.int32)), 128, None, f16(half(s, "d", s.grp)), None)


# --- K-quants (256-value super-blocks; region aux: the block's scale bytes in ggml order) ---

def _q2_k(s):  # vshape (2, 16): axis 0 = the 16-value sub-block; aux = scales[16] | d | dmin
    sb, sub = s.grp >> 3, (s.grp & 7) * 2 + s.ax[0]
    sc = byte(s, "aux", sb * 20 + sub)
    d, dmin = f16(half(s, "aux", sb * 10 + 8)), f16(half(s, "aux", sb * 10 + 9))
    return Codes(plane(s, "q2", 2), 0, None, d * _f(sc & 0xF), -(dmin * _f(sc >> 4)))


def _q3_k(s):  # vshape (2, 16); aux = scales[12] (6-bit, packed) | d
    sb, sub = s.grp >> 3, (s.grp & 7) * 2 + s.ax[0]
    lsc = byte(s, "aux", sb * 14 + (sub & 7)) >> _u((sub >> 3) * 4)
    hsc = byte(s, "aux", sb * 14 + 8 + (sub & 3)) >> _u((sub >> 2) * 2)
    sc = ((lsc & 0x0F) | ((hsc & 0x03) << 4)).astype(jnp.int32) - 32
    d = f16(half(s, "aux", sb * 7 + 6))
    u = plane(s, "q2", 2) | (plane(s, "q1", 1) << 2)  # ggml: q - (hmask bit ? 0 : 4) == (q | bit << 2) - 4
    return Codes(u, 4, None, d * _f(sc), None)


def _scale_min_k4(s, sb):
    """ggml get_scale_min_k4 of the tile's groups (sub-blocks of 32): aux = d | dmin | scales[12]."""
    j = s.grp & 7
    jj = j & 3
    a = byte(s, "aux", sb * 16 + 4 + jj)
    b = byte(s, "aux", sb * 16 + 8 + jj)
    c = byte(s, "aux", sb * 16 + 12 + jj)
    hi = j >= 4
    sc = jnp.where(hi, (c & 0xF) | ((a >> 2) & 0x30), a & 63)
    mn = jnp.where(hi, (c >> 4) | ((b >> 2) & 0x30), b & 63)
    d, dmin = f16(half(s, "aux", sb * 8)), f16(half(s, "aux", sb * 8 + 1))
    return d * _f(sc), -(dmin * _f(mn))


def _q4_k(s):
    dl, mn = _scale_min_k4(s, s.grp >> 3)
    return Codes(plane(s, "q4", 4), 0, None, dl, mn)


def _q5_k(s):
    dl, mn = _scale_min_k4(s, s.grp >> 3)
    return Codes(plane(s, "q4", 4) | (plane(s, "q1", 1) << 4), 0, None, dl, mn)


def _q6_k(s):  # vshape (4, 8): sub-block of 16 = axis 0 // 2; aux = scales[16] (int8) | d
    sb, sub = s.grp >> 3, (s.grp & 7) * 2 + (s.ax[0] >> 1)
    sc = (byte(s, "aux", sb * 18 + sub) ^ 0x80).astype(jnp.int32) - 128
    d = f16(half(s, "aux", sb * 9 + 8))
    return Codes(plane(s, "q4", 4) | (plane(s, "q2", 2) << 4), 32, None, d * _f(sc), None)


def _iq4_xs(s):  # aux = d | scales_h (u16) | scales_l[4]
    sb, j = s.grp >> 3, s.grp & 7
    d, sh = f16(half(s, "aux", sb * 4)), half(s, "aux", sb * 4 + 1)
    sl = (byte(s, "aux", sb * 8 + 4 + (j >> 1)) >> _u((j & 1) * 4)) & 0xF
    ls = (sl | (((sh >> _u(2 * j)) & 3) << 4)).astype(jnp.int32) - 32
    return Codes(s.table("iq4", plane(s, "q4", 4).astype(jnp.int32)), 128, None, d * _f(ls), None)


# --- IQ grid formats: vshape (4, 2, 4) = (8-value entry a, half h, value t); value 8a + 4h + t of the group ---

def _grid_level(s, name, entry_word):
    """The grid value bytes of each value: the table word (4 values) at ``entry_word``, byte t."""
    return (s.table(name, entry_word) >> _u(8 * s.ax[2])) & 0xFF


def _entries(s):
    return s.grp * 4 + s.ax[0]                     # row-relative 8-value entry index [1, G, 4, 1, 1]


def _iq2_dl16(s, d, scale_byte0):
    """IQ2_XS / IQ2_S: one 4-bit scale per 16 values, ``d * (0.5 + ls) * 0.25``."""
    sb, sub = s.grp >> 3, (s.grp & 7) * 2 + (s.ax[0] >> 1)
    ls = (byte(s, "aux", sb * 10 + scale_byte0 + (sub >> 1)) >> _u((sub & 1) * 4)) & 0xF
    return (d * _f(2 * ls + 1)) * jnp.float32(0.125)


def _sign_bit(s, sign8):
    return (sign8 >> _u(4 * s.ax[1] + s.ax[2])) & 1


def _iq2_xxs(s):  # qs: per group 4 grid index bytes | u32 (4 x 7-bit sign index, 4-bit scale)
    gidx = byte(s, "qs", s.grp * 8 + s.ax[0]).astype(jnp.int32)
    aux = s.words("qs", s.grp * 2 + 1)
    sign8 = _ksign((aux >> _u(7 * s.ax[0])) & 0x7F)
    d = f16(half(s, "d", s.grp >> 3))
    dl = (d * _f(2 * (aux >> 28) + 1)) * jnp.float32(0.125)
    return Codes(_grid_level(s, "grid_iq2xxs", gidx * 2 + s.ax[1]), 0, _sign_bit(s, sign8), dl, None)


def _iq2_xs(s):  # e16: per entry u16 = 9-bit grid index | 7-bit sign index; aux = d | scales[8]
    q = half(s, "e16", _entries(s))
    gidx = (q & 511).astype(jnp.int32)
    dl = _iq2_dl16(s, f16(half(s, "aux", (s.grp >> 3) * 5)), 2)
    return Codes(_grid_level(s, "grid_iq2xs", gidx * 2 + s.ax[1]), 0, _sign_bit(s, _ksign(q >> 9)), dl, None)


def _iq2_s(s):  # e16: per entry qs | signs << 8; e2: 2 high grid-index bits per entry; aux = d | scales[8]
    e = _entries(s)
    q = half(s, "e16", e)
    hi = (s.words("e2", e >> 4) >> _u(2 * (e & 15))) & 3
    gidx = ((q & 0xFF) | (hi << 8)).astype(jnp.int32)
    dl = _iq2_dl16(s, f16(half(s, "aux", (s.grp >> 3) * 5)), 2)
    return Codes(_grid_level(s, "grid_iq2s", gidx * 2 + s.ax[1]), 0, _sign_bit(s, q >> 8), dl, None)


def _iq3_xxs(s):  # e16: two 8-bit grid indices (4 values each) per entry; sas: per group u32 signs + scale
    q = half(s, "e16", _entries(s))
    gidx = ((q >> _u(8 * s.ax[1])) & 0xFF).astype(jnp.int32)
    sas = s.words("sas", s.grp)
    sign8 = _ksign((sas >> _u(7 * s.ax[0])) & 0x7F)
    d = f16(half(s, "d", s.grp >> 3))
    dl = (d * _f(2 * (sas >> 28) + 1)) * jnp.float32(0.25)
    return Codes(_grid_level(s, "grid_iq3xxs", gidx), 0, _sign_bit(s, sign8), dl, None)


def _iq3_s(s):  # e16: two low index bytes per entry; qh: bit 8 per 4 values; s8: sign byte per entry
    e = _entries(s)
    q = half(s, "e16", e)
    quarter = 2 * e + s.ax[1]
    hi = (s.words("qh", quarter >> 5) >> _u(quarter & 31)) & 1
    gidx = (((q >> _u(8 * s.ax[1])) & 0xFF) | (hi << 8)).astype(jnp.int32)
    sb, j = s.grp >> 3, s.grp & 7
    ls = (byte(s, "aux", sb * 6 + 2 + (j >> 1)) >> _u((j & 1) * 4)) & 0xF
    dl = f16(half(s, "aux", sb * 3)) * _f(1 + 2 * ls)
    return Codes(_grid_level(s, "grid_iq3s", gidx), 0, _sign_bit(s, byte(s, "s8", e)), dl, None)


def _iq1_code(s, name, gidx, delta_neg):
    """IQ1: ``grid + delta`` as ``(8 grid + 1 - 2 delta_neg) / 8``; the table holds grid + 1 (0, 1, 2)."""
    gb = _grid_level(s, name, gidx * 2 + s.ax[1])
    return 8 * gb + 9 - 2 * delta_neg


def _iq1_s(s):  # qs: low 8 index bits per entry; qh: per group u16 = 4 x 3 high bits | 3-bit scale | delta sign
    e = _entries(s)
    qh = half(s, "qh", s.grp)
    gidx = (byte(s, "qs", e) | (((qh >> _u(3 * s.ax[0])) & 7) << 8)).astype(jnp.int32)
    d = f16(half(s, "d", s.grp >> 3))
    dl = (d * _f(2 * ((qh >> 12) & 7) + 1)) * jnp.float32(0.125)
    return Codes(_iq1_code(s, "grid_iq1s", gidx, (qh >> 15) & 1), 16, None, dl, None)


def _iq1_m(s):  # qs: low 8 index bits; qh: nibble per entry = 3 high bits | delta sign; sc: 4 u16 (3-bit scales, d)
    e = _entries(s)
    nib = (s.words("qh", e >> 3) >> _u(4 * (e & 7))) & 0xF
    gidx = (byte(s, "qs", e) | ((nib & 7) << 8)).astype(jnp.int32)
    sb = s.grp >> 3
    w = [half(s, "sc", sb * 4 + i) for i in range(4)]
    dbits = (w[0] >> 12) | ((w[1] >> 8) & 0xF0) | ((w[2] >> 4) & 0xF00) | (w[3] & 0xF000)
    sub = (s.grp & 7) * 2 + (s.ax[0] >> 1)
    ls = (half(s, "sc", sb * 4 + (sub >> 2)) >> _u(3 * (sub & 3))) & 7
    dl = (f16(dbits) * _f(2 * ls + 1)) * jnp.float32(0.125)
    return Codes(_iq1_code(s, "grid_iq1m", gidx, (nib >> 3) & 1), 16, None, dl, None)


DECODERS = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.IQ4_NL: _iq4_nl,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.IQ4_XS: _iq4_xs,
    Q.IQ2_XXS: _iq2_xxs, Q.IQ2_XS: _iq2_xs, Q.IQ2_S: _iq2_s, Q.IQ3_XXS: _iq3_xxs, Q.IQ3_S: _iq3_s,
    Q.IQ1_S: _iq1_s, Q.IQ1_M: _iq1_m,
}
_IQ = (4, 2, 4)
VSHAPE = {q: (4, 8) for q in DECODERS} | {Q.Q8_0: (8, 4), Q.Q2_K: (2, 16), Q.Q3_K: (2, 16)} | {
    q: _IQ for q in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M)}
#: the constant tables each format's decoder reads (kernel inputs, in this order)
TABLES = {Q.IQ4_NL: ("iq4",), Q.IQ4_XS: ("iq4",), Q.IQ2_XXS: ("grid_iq2xxs",), Q.IQ2_XS: ("grid_iq2xs",),
          Q.IQ2_S: ("grid_iq2s",), Q.IQ3_XXS: ("grid_iq3xxs",), Q.IQ3_S: ("grid_iq3s",), Q.IQ1_S: ("grid_iq1s",),
          Q.IQ1_M: ("grid_iq1m",)}


@functools.lru_cache(maxsize=None)
def table(name: str) -> np.ndarray:
    """A decoder's constant table as uint32 (grid entries as little-endian bytes, 4 per word)."""
    if name == "iq4":
        return (np.asarray(_gq.IQ4_NL.kvalues, np.int32) + 128).astype(np.uint32)
    cls = {"grid_iq2xxs": "IQ2_XXS", "grid_iq2xs": "IQ2_XS", "grid_iq2s": "IQ2_S", "grid_iq3xxs": "IQ3_XXS",
           "grid_iq3s": "IQ3_S", "grid_iq1s": "IQ1_S", "grid_iq1m": "IQ1_M"}[name]
    g = getattr(_gq, cls)
    g.init_grid()
    vals = np.asarray(g.grid, np.float32).reshape(g.grid_shape)     # [entries, 4 or 8]
    if cls.startswith("IQ1"):
        vals = vals + 1                                              # -1, 0, 1 -> 0, 1, 2
    b = vals.astype(np.int64).astype(np.uint8)
    return np.ascontiguousarray(b).view("<u4").reshape(-1).astype(np.uint32)
