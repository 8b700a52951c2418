"""The planar device format: GGUF block formats repacked once at load into word-aligned planes.

Source: ggml's block structs (``ggml/src/ggml-common.h``) and ``dequantize_row_*`` (``ggml/src/ggml-quants.c``), as
decoded by `strata_jax.gguf.blocks` (bit-identical to gguf-py). The repack is an exact, lossless rearrangement of
each row's bits; nothing is rounded or widened.

Why: the GGUF block sizes (34, 18, 22, 84, 110, 210, 74, 98 ... bytes) put a block's fields at byte offsets that no
vector load can reach aligned, so a kernel reading the file's layout gathers single bytes (and re-reads each scale
for every value). In the planar layout each row of a matrix is a few *regions* of 32-bit words, each region
padded to 16 bytes:

* **code planes** hold per-value bit fields in natural value order, least significant bits first: a ``b``-bit
  plane packs ``32 / b`` consecutive values per word (value ``v`` of the row is bits ``(v*b) % 32`` .. of word
  ``v*b // 32``), so the codes of consecutive values are consecutive words (16-byte loads, coalesced across a
  warp). Q5 formats are a 4-bit plane plus a 1-bit plane, Q6_K 4 + 2 bits, Q3_K 2 + 1 bits.
* **entry regions** of the IQ formats keep ggml's per-8-value fields (grid indices, sign bytes, high index bits)
  byte for byte, in natural entry order.
* **scale regions** hold the remaining bytes of each block (fp16 ``d`` / ``dmin``, packed sub-block scales) in
  ggml's byte order, one fixed-size record per block.

A planar matrix is a uint32 array ``[..., rows, row_words(qtype, n_cols)]`` (stacked experts keep their leading
axis); `is_planar` tells it from the uint8 GGUF bytes. Its size is that of the GGUF rows up to the 16-byte padding
of each region (+0-4% at the model shapes). `repack` makes it (a jitted jnp function: on the device at load time,
tensor by tensor, so the peak is one extra tensor); `dequantize` decodes it to float32 bit-identically to
`strata_jax.gguf.blocks.dequantize` of the original bytes (through the same decoders the kernels run,
`strata_jax.pallas.quant_matmul.decode`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from strata_jax.errors import StrataError
from strata_jax.pallas.quant_matmul import decode as _dec

GROUP = 32        # values per group: the unit of the kernels' tiles (every format's block is 32 or 256 values)
ALIGN_WORDS = 4   # regions are padded to 16 bytes


@dataclasses.dataclass(frozen=True)
class PlanarFormat:
    """How one GGUF format is laid out in planes.

    Attributes:
      qtype: the GGUF format.
      QB: values per ggml block.
      regions: (name, bytes per ggml block) in row order.
      split: ggml blocks uint8 [..., nb, bytes_per_block] -> {region: uint8 [..., nb, bytes]} (the repack).
    """
    qtype: Q
    QB: int
    regions: tuple[tuple[str, int], ...]
    split: object


def _u32(b):
    return jnp.asarray(b).astype(jnp.uint32)


def _pack_bits(u, bits: int):
    """uint [..., n] values < 2**bits -> uint8 [..., n * bits / 8], least significant bits first (bits 1, 2, 4)."""
    per = 8 // bits
    u = _u32(u).reshape(*u.shape[:-1], u.shape[-1] // per, per)
    out = u[..., 0]
    for t in range(1, per):
        out = out | (u[..., t] << (bits * t))
    return out.astype(jnp.uint8)


def _shr_flat(b, shifts, mask):
    """uint8 [..., n] -> [..., len(shifts) * n]: ``(b >> s) & mask`` for each shift s, shift-major."""
    b = _u32(b)
    return jnp.concatenate([(b >> s) & mask for s in shifts], axis=-1)


def _nib32(qs):
    """16 bytes of a 32-value block (low nibbles = values 0..15, high = 16..31) -> the 32 values in order."""
    return _shr_flat(qs, (0, 4), 0xF)


def _k_nibbles(qs, n_runs: int):
    """K-quant nibbles: runs of bytes whose low nibbles hold one run of values and high nibbles the next (Q4_K:
    4 runs of 32 bytes, Q6_K's ql: 2 runs of 64)."""
    r = qs.reshape(*qs.shape[:-1], n_runs, qs.shape[-1] // n_runs)
    return _shr_flat(r, (0, 4), 0xF).reshape(*qs.shape[:-1], 2 * qs.shape[-1])


def _k_crumbs(qs, n_runs: int):
    """Q2_K-style 2-bit codes: 32-byte runs, each byte holding 4 values 32 apart (shift 0, 2, 4, 6)."""
    r = qs.reshape(*qs.shape[:-1], n_runs, 32)
    return _shr_flat(r, (0, 2, 4, 6), 0x3).reshape(*qs.shape[:-1], n_runs * 128)


def _bits8(b):
    """32 bytes whose bit i of byte l is value i*32 + l -> the 256 values' bits in order."""
    return _shr_flat(b, range(8), 0x1)


def _cat(*parts):
    return jnp.concatenate(parts, axis=-1)


def _interleave(a, b):
    return jnp.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])


_P = PlanarFormat
FORMATS: dict[Q, PlanarFormat] = {f.qtype: f for f in [
    _P(Q.Q8_0, 32, (("q8", 32), ("d", 2)), lambda b: {"q8": b[..., 2:34], "d": b[..., 0:2]}),
    _P(Q.Q4_0, 32, (("q4", 16), ("d", 2)), lambda b: {"q4": _pack_bits(_nib32(b[..., 2:18]), 4), "d": b[..., 0:2]}),
    _P(Q.Q4_1, 32, (("q4", 16), ("dm", 4)),
       lambda b: {"q4": _pack_bits(_nib32(b[..., 4:20]), 4), "dm": b[..., 0:4]}),
    _P(Q.Q5_0, 32, (("q4", 16), ("q1", 4), ("d", 2)),
       lambda b: {"q4": _pack_bits(_nib32(b[..., 6:22]), 4), "q1": b[..., 2:6], "d": b[..., 0:2]}),
    _P(Q.Q5_1, 32, (("q4", 16), ("q1", 4), ("dm", 4)),
       lambda b: {"q4": _pack_bits(_nib32(b[..., 8:24]), 4), "q1": b[..., 4:8], "dm": b[..., 0:4]}),
    _P(Q.Q2_K, 256, (("q2", 64), ("aux", 20)),
       lambda b: {"q2": _pack_bits(_k_crumbs(b[..., 16:80], 2), 2), "aux": _cat(b[..., 0:16], b[..., 80:84])}),
    _P(Q.Q3_K, 256, (("q2", 64), ("q1", 32), ("aux", 14)),
       lambda b: {"q2": _pack_bits(_k_crumbs(b[..., 32:96], 2), 2), "q1": _pack_bits(_bits8(b[..., 0:32]), 1),
                  "aux": b[..., 96:110]}),
    _P(Q.Q4_K, 256, (("q4", 128), ("aux", 16)),
       lambda b: {"q4": _pack_bits(_k_nibbles(b[..., 16:144], 4), 4), "aux": b[..., 0:16]}),
    _P(Q.Q5_K, 256, (("q4", 128), ("q1", 32), ("aux", 16)),
       lambda b: {"q4": _pack_bits(_k_nibbles(b[..., 48:176], 4), 4), "q1": _pack_bits(_bits8(b[..., 16:48]), 1),
                  "aux": b[..., 0:16]}),
    _P(Q.Q6_K, 256, (("q4", 128), ("q2", 64), ("aux", 18)),
       lambda b: {"q4": _pack_bits(_k_nibbles(b[..., 0:128], 2), 4), "q2": _pack_bits(_k_crumbs(b[..., 128:192], 2), 2),
                  "aux": b[..., 192:210]}),
    _P(Q.IQ4_NL, 32, (("q4", 16), ("d", 2)),
       lambda b: {"q4": _pack_bits(_nib32(b[..., 2:18]), 4), "d": b[..., 0:2]}),
    _P(Q.IQ4_XS, 256, (("q4", 128), ("aux", 8)),
       lambda b: {"q4": _pack_bits(_shr_flat(b[..., 8:136].reshape(*b.shape[:-1], 8, 16), (0, 4), 0xF)
                                   .reshape(*b.shape[:-1], 256), 4), "aux": b[..., 0:8]}),
    _P(Q.IQ2_XXS, 256, (("qs", 64), ("d", 2)), lambda b: {"qs": b[..., 2:66], "d": b[..., 0:2]}),
    _P(Q.IQ2_XS, 256, (("e16", 64), ("aux", 10)),
       lambda b: {"e16": b[..., 2:66], "aux": _cat(b[..., 0:2], b[..., 66:74])}),
    _P(Q.IQ2_S, 256, (("e16", 64), ("e2", 8), ("aux", 10)),
       lambda b: {"e16": _interleave(b[..., 2:34], b[..., 34:66]), "e2": b[..., 66:74],
                  "aux": _cat(b[..., 0:2], b[..., 74:82])}),
    _P(Q.IQ3_XXS, 256, (("e16", 64), ("sas", 32), ("d", 2)),
       lambda b: {"e16": b[..., 2:66], "sas": b[..., 66:98], "d": b[..., 0:2]}),
    _P(Q.IQ3_S, 256, (("e16", 64), ("qh", 8), ("s8", 32), ("aux", 6)),
       lambda b: {"e16": b[..., 2:66], "qh": b[..., 66:74], "s8": b[..., 74:106],
                  "aux": _cat(b[..., 0:2], b[..., 106:110])}),
    _P(Q.IQ1_S, 256, (("qs", 32), ("qh", 16), ("d", 2)),
       lambda b: {"qs": b[..., 2:34], "qh": b[..., 34:50], "d": b[..., 0:2]}),
    _P(Q.IQ1_M, 256, (("qs", 32), ("qh", 16), ("sc", 8)),
       lambda b: {"qs": b[..., 0:32], "qh": b[..., 32:48], "sc": b[..., 48:56]}),
]}
assert set(FORMATS) == set(_dec.DECODERS)
for _f in FORMATS.values():  # the regions hold every byte of a block exactly once (the repack is lossless)
    assert sum(n for _, n in _f.regions) == GGML_QUANT_SIZES[_f.qtype][1], _f.qtype


@dataclasses.dataclass(frozen=True)
class Layout:
    """Word offsets of one row's regions. ``offsets[name]`` / ``words[name]``: start and padded length in words."""
    qtype: Q
    n_cols: int
    offsets: dict
    words: dict
    row_words: int


@functools.lru_cache(maxsize=None)
def layout(qtype, n_cols: int) -> Layout:
    """The planar row layout of ``n_cols`` values of format ``qtype``.

    Raises:
      StrataError: ``qtype`` has no planar form, or ``n_cols`` is not a whole number of its blocks.
    """
    f = FORMATS.get(Q(qtype))
    if f is None:
        raise StrataError(f"no planar layout for {getattr(qtype, 'name', qtype)}")
    if n_cols <= 0 or n_cols % f.QB:
        raise StrataError(f"a {f.qtype.name} row of {n_cols} values is not a whole number of {f.QB}-value blocks")
    nb = n_cols // f.QB
    offsets, words, off = {}, {}, 0
    for name, nbytes in f.regions:
        w = -(-(nb * nbytes) // (4 * ALIGN_WORDS)) * ALIGN_WORDS
        offsets[name], words[name] = off, w
        off += w
    return Layout(f.qtype, n_cols, offsets, words, off)


def row_words(qtype, n_cols: int) -> int:
    """uint32 words per planar row."""
    return layout(qtype, n_cols).row_words


def is_planar(w, qtype) -> bool:
    """Whether ``w`` is a planar matrix (uint32) of a block format, as opposed to GGUF bytes (uint8) or floats."""
    return getattr(w, "dtype", None) == jnp.uint32 and Q(qtype) in FORMATS


@functools.partial(jax.jit, static_argnames=("qtype", "n_cols"))
def repack(raw, *, qtype, n_cols: int):
    """GGUF rows uint8 [..., row_bytes] -> planar uint32 [..., row_words] (exact; see the module docstring).

    Raises:
      StrataError: no planar form for ``qtype``, or ``raw``'s last axis is not ``n_cols`` values of it.
    """
    qtype = Q(qtype)
    lay = layout(qtype, n_cols)
    f = FORMATS[qtype]
    qb, bpb = GGML_QUANT_SIZES[qtype]
    nb = n_cols // qb
    if raw.dtype != jnp.uint8 or raw.shape[-1] != nb * bpb:
        raise StrataError(f"{qtype.name} rows must be uint8 [..., {nb * bpb}], got {raw.dtype} {raw.shape}")
    lead = raw.shape[:-1]
    parts = f.split(raw.reshape(*lead, nb, bpb))
    out = []
    for name, nbytes in f.regions:
        r = parts[name].astype(jnp.uint8).reshape(*lead, nb * nbytes)
        r = jnp.pad(r, [(0, 0)] * len(lead) + [(0, 4 * lay.words[name] - nb * nbytes)])
        out.append(r)
    b = jnp.concatenate(out, axis=-1).reshape(*lead, lay.row_words, 4)
    return jax.lax.bitcast_convert_type(b, jnp.uint32)


class _JnpSource(_dec.Source):
    """`decode.Source` over a whole planar array in jnp: every row, every group (the reference decoder)."""

    def __init__(self, planar, lay: Layout):
        R = int(np.prod(planar.shape[:-1], dtype=np.int64))
        self.flat = planar.reshape(-1)
        self.lay = lay
        self.rows = jnp.arange(R, dtype=jnp.int32)
        super().__init__(jnp.arange(lay.n_cols // GROUP, dtype=jnp.int32), _dec.VSHAPE[lay.qtype])

    def words(self, region, idx):
        rows = self.rows.reshape((-1,) + (1,) * (idx.ndim - 1))
        return self.flat[rows * self.lay.row_words + self.lay.offsets[region] + idx]

    def table(self, name, idx):
        return jnp.asarray(_dec.table(name))[idx]


@functools.partial(jax.jit, static_argnames=("qtype", "n_cols"))
def dequantize(planar, *, qtype, n_cols: int):
    """Planar uint32 [..., row_words] -> float32 [..., n_cols], bit-identical to `strata_jax.gguf.blocks.dequantize`
    of the GGUF bytes it was repacked from (finite scales)."""
    qtype = Q(qtype)
    lay = layout(qtype, n_cols)
    if planar.dtype != jnp.uint32 or planar.shape[-1] != lay.row_words:
        raise StrataError(f"planar {qtype.name} rows must be uint32 [..., {lay.row_words}], "
                          f"got {planar.dtype} {planar.shape}")
    src = _JnpSource(planar, lay)
    c = _dec.DECODERS[qtype](src)
    w = _dec.values(c)
    return w.reshape(*planar.shape[:-1], n_cols)
