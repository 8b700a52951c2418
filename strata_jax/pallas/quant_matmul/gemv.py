"""Pallas GEMV for 1..8 activation rows on planar weights (`planar`) and F16 / BF16 / F32 weights: float32
products on the CUDA cores, every weight word read once per call.

Source: the block formats of ggml (``ggml-common.h``, via `strata_jax.pallas.quant_matmul.decode`); the design
points from llama.cpp's MMVQ (``ggml/src/ggml-cuda/mmvq.cu``): wide loads of the codes, the sub-block scale applied
once per sub-block sum rather than per value, all rows of the call sharing one read of each weight word. Unlike
MMVQ the activations stay float32 (no 8-bit quantization), so results are float32-accurate (~1e-6 relative).

Grid: (output tiles of ``BN`` rows, K splits, slots). A program decodes, per loop step, a ``[BN, G, *vshape]``
tile (G groups of 32 values; `decode.VSHAPE`) and for each activation row m accumulates
``sum_units dl * sum(code * x_m) + mn * sum(x_m)`` into a [BN, G] float32 accumulator; the K splits are summed in
a fixed order afterwards. The loop's trip count is a compile-time constant.

Row invariance: every tensor a row's arithmetic touches has a shape that does not depend on the number of rows,
and the rows run one after another in the unrolled program, so row m's instructions are the same whatever M is
(compiled: M is rounded up to 1, 2, 4 or 8 to bound the compiled variants; interpret mode: always 8, because XLA
fuses the interpreted body differently for different M). Launch parameters depend only on the weight (format,
n_out, K, the plane path) and the table (``STRATA_QMATMUL_GEMV_CONFIGS``), and the K split on the call site's
``split_units``, never on M or on the number of slots a launch serves (`grouped_gemv`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from gguf.constants import GGMLQuantizationType as Q
from jax.experimental import pallas as pl

from strata_jax.layers import exact
from strata_jax.pallas import dispatch
from strata_jax.pallas.quant_matmul import decode as D
from strata_jax.pallas.quant_matmul import planar as P
from strata_jax.pallas.quant_matmul.formats import FLOAT_TYPES

M_MAX = 8
FLOAT_VSHAPE = (4, 8)


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch parameters of the planar GEMV (a function of the weight only, never of M).

    Defaults from `experiments/sweep_kernels.py` on the H200 (2026-12-03, 16 configs at every GEMV shape of the
    1.5B file and of Flash-Next, device time weighted by calls per token): (32, 4, 4 warps, 1056) is within 2.5%
    of the best config at one row (1.03 vs 1.01 ms of GEMVs per 1.5B token) and the best at 8 rows (-17% on the
    1.5B shapes, -27% on Flash-Next's against (16, 8, 4, 2112))."""
    BN: int = 32                 # weight rows per program
    G: int = 4                   # 32-value groups per loop step (reduced to divide K / 32)
    target_programs: int = 1056  # split K until the grid has at least this many programs (8 per H200 SM)
    num_warps: int = 4
    num_stages: int = 2
    tag: str = ""                # appended to the kernel's name (sweeps tell their variants apart in a trace)


DEFAULT = Config()
# the other configs the tables below pick from, named by shape (one config serves several formats)
NARROW = Config(BN=16, G=8, target_programs=2112)                     # 16 weight rows, 8 groups per step
WIDE = Config(BN=32, G=8, target_programs=528)                        # 32 weight rows, 8 groups, fewer programs
TWO_WARPS = Config(BN=16, G=8, num_warps=2, target_programs=2112)     # NARROW on 2 warps
ONE_STEP = Config(BN=32, G=4, target_programs=4224)                   # K split until a program runs one loop step

# From experiments/sweep_kernels.py on the H200 (2026-12-04, experiments/results/h200_2026-12-04/call{2,3}), device
# time per shape at 1 and 8 rows: the plane path's Q4_K is fastest with (16, 8, 4, 2112) at the 1.5B file's K =
# 1536 / 8960 x 1536 shapes (gate+up 8960x1536: 9.76 / 40.13 us against 10.98 / 42.68 with DEFAULT) and with (32,
# 8, 4, 528) at Flash-Next's K >= 2560 (attn_gate 6144x2560: 7.04 / 19.30 us against 7.36 / 34.68; per token at
# one row within 1% of the best config); the Q6_K output head (decoder path) with (32, 8, 4, 528) at one row
# (151936x1536: 121.3 against 142.2 us; Flash-Next's 248320x2560: 311.8 against 359.4 us).
PLANES_Q4K_SMALL_K = NARROW
PLANES_Q4K = HEAD_Q6K = WIDE
HEAD_ROWS = 65536   # a weight with this many output rows or more is an output head / embedding
# From experiments/sweep_kernels.py on an H100 with each call's weights out of L2 (2026-12-07, fourth session,
# experiments/results/h100_2026-12-07d/call1; 20 configs at every GEMV shape of the 1.5B file and of Flash-Next,
# 1 row, and 8 rows at the three largest): per format the config with the least device time per token at one row
# that is not slower at 8 rows where 8 rows were timed. Flash-Next, one row: 4,823 -> 4,306 us of GEMVs per token
# (the 2026-12-04 choices above); 8 rows (3 largest shapes) 6,066 -> 5,842; the 1.5B file 1,026 -> 964 / 2,348 ->
# 2,301 (the routed experts' 8-row figures with 10 slots, not the engine's union of up to 80: see RESULTS).
# Q4_K (plane path) at K >= 2048 and the Q6_K head: (16, 8, 2 warps, 2112) (attn_gate 6144x2560 9.26 -> 7.86 us,
# ssm_out 2560x6144 8.99 -> 7.53); Q2_K: (16, 8, 4, 2112) (the experts' gate+up 15.38 -> 12.70 us, 8 rows 68.2 ->
# 64.8); other Q6_K: (32, 4, 4, 4224) (one loop step per program: 1536x8960 12.93 -> 10.99); Q8_0: (32, 8, 4, 528);
# float weights: (32, 4, 4, 4224) (the hyper-connection projections 4.3 -> 3.9 us, the small ones 1.7 -> 1.4).
# Q4_0 takes TWO_WARPS at every K (its one measured shape: the experts' down, K = 640); the decoder path's Q4_K
# (STRATA_QMATMUL_PLANES=0, for comparisons) keeps DEFAULT. Decode A/B on the 16-layer Flash-Next steps (H100,
# call 3): 2.714 ms per token against 2.833 with the 2026-12-04 table (0.958).
CONFIG_TABLES = ("2026-12-07", "2026-12-04")


def config_table() -> str:
    """``STRATA_QMATMUL_GEMV_CONFIGS``: which measured table `choose_config` uses, ``2026-12-07`` (the default) or
    ``2026-12-04`` (the one before, for A/B runs). Read when a call is traced.

    Raises:
      UnsupportedError: another value."""
    return dispatch.env_choice("STRATA_QMATMUL_GEMV_CONFIGS", CONFIG_TABLES[0], CONFIG_TABLES)


def choose_config(qtype, n_out: int, k_in: int) -> Config:
    """Launch parameters for a weight: a function of the format, the shape and the path (`uses_planes`), never of
    the row count, so a row's reduction order is the same in every window."""
    planes = uses_planes(qtype)
    if config_table() == "2026-12-04":
        if qtype == Q.Q4_K and planes:
            return PLANES_Q4K if k_in >= 2048 else PLANES_Q4K_SMALL_K
        if qtype == Q.Q6_K and n_out >= HEAD_ROWS and not planes:
            return HEAD_Q6K
        return DEFAULT
    if qtype == Q.Q4_K and not planes:
        return DEFAULT
    if qtype == Q.Q4_K and k_in < 2048:
        return NARROW
    if qtype in (Q.Q4_K, Q.Q4_0) or (qtype == Q.Q6_K and n_out >= HEAD_ROWS):
        return TWO_WARPS
    if qtype == Q.Q2_K:
        return NARROW
    if qtype == Q.Q6_K or qtype in FLOAT_TYPES:
        return ONE_STEP
    if qtype == Q.Q8_0:
        return WIDE
    return DEFAULT


def vshape(qtype) -> tuple:
    return FLOAT_VSHAPE if qtype in FLOAT_TYPES else D.VSHAPE[qtype]


def split_k(n_units: int, n_tiles: int, per_unit: int, target: int) -> dict:
    """K splits: ``n_units`` loop steps over the row cut into ``split`` splits of ``cps`` steps each (a
    compile-time trip count; a divisor near the target is preferred, otherwise the last split is ``masked``: its
    steps past the end are read clamped and add nothing). ``per_unit``: programs per (tile, split), e.g. slots."""
    split = max(1, min(n_units, -(-target // max(1, n_tiles * per_unit))))
    cps0 = -(-n_units // split)
    cps = next((c for c in range(cps0, min(2 * cps0, n_units) + 1) if n_units % c == 0), cps0)
    split = -(-n_units // cps)
    return dict(split=split, cps=cps, masked=split * cps != n_units)


def tiling(qtype, n_out: int, k_in: int, cfg: Config, per_unit: int = 1) -> dict:
    """{G (groups per loop step, cut to divide K / 32), n_chunks (loop steps over K), n_tiles (output tiles of
    ``cfg.BN`` rows), and `split_k`'s split / cps / masked} for a weight under ``cfg`` (also `tcgemv`'s: any config
    with BN, G, target_programs). ``per_unit``: programs per (tile, split) the split is sized for, a constant of the
    call site (`grouped_gemv`'s ``split_units``), never a row or slot count."""
    n_groups = k_in // P.GROUP
    G = cfg.G
    while G > 1 and n_groups % G:
        G //= 2
    n_chunks = n_groups // G
    n_tiles = -(-n_out // cfg.BN)
    return dict(G=G, n_chunks=n_chunks, n_tiles=n_tiles, **split_k(n_chunks, n_tiles, per_unit, cfg.target_programs))


def why_not(qtype, n_out: int, k_in: int, w_dtype, n_mats: int = 1) -> str | None:
    """None when the planar kernels (this GEMV and `gemm`) serve this weight, else the reason."""
    if qtype in FLOAT_TYPES:
        if k_in % P.GROUP:
            return f"K={k_in} is not a multiple of {P.GROUP}"
        n_words = n_out * k_in * jnp.dtype(FLOAT_TYPES[qtype]).itemsize // 4
    elif qtype in P.FORMATS:
        if jnp.dtype(w_dtype) != jnp.dtype(jnp.uint32):
            return "the weight is not in the planar layout"
        n_words = n_out * P.row_words(qtype, k_in)
    else:
        return f"format {getattr(qtype, 'name', qtype)} has no planar kernel"
    if n_words * n_mats >= 2 ** 31:
        return f"weight of {n_words * n_mats} words (int32 offsets)"
    return None


class RefSource(D.Source):
    """`decode.Source` inside a kernel: gathers from the flat weight ref at the tile's rows.

    ``a0`` / ``n_a``: restrict the first value axis to ``a0 .. a0 + n_a`` (one scale unit of a group, for the
    tensor-core kernel)."""

    def __init__(self, w_ref, rows, lay, grp, vs, tables, a0: int = 0, n_a: int | None = None):
        super().__init__(grp, (n_a or vs[0],) + tuple(vs[1:]))
        if a0:
            self.ax[0] = self.ax[0] + a0
        self.vshape = tuple(vs)       # strides come from the full group layout
        self.w_ref = w_ref
        self.rows = rows
        self.lay = lay
        self.tables = tables

    def words(self, region, idx):
        return self.w_ref[self.rows * self.lay.row_words + self.lay.offsets[region] + idx]

    def table(self, name, idx):
        return self.tables[name][idx]


def tile_rows(i, e, BN: int, n_out: int, nd: int):
    """int32 [BN, 1, ...] (``nd`` axes) rows of the stacked weight ref read by output tile ``i`` of matrix ``e``:
    rows past ``n_out`` clamped to the last one (their outputs are masked by the caller's store)."""
    r = jnp.minimum(i * BN + lax.broadcasted_iota(jnp.int32, (BN,), 0), n_out - 1)
    return (e * n_out + r).reshape((BN,) + (1,) * (nd - 1))


def split_step(s, j, cps: int, n_steps: int, masked: bool):
    """(loop step index, live) of step ``j`` in K split ``s`` of ``cps`` steps: on the ragged last split a step past
    ``n_steps`` reads the last step again (``live`` False: the caller adds nothing for it)."""
    c = s * cps + j
    live = c < n_steps
    if masked:
        c = jnp.minimum(c, n_steps - 1)
    return c, live


def decode_tile(qtype, w_ref, rows, grp, k_in, tables, a0=0, n_a=None):
    """(float32 codes or weights [BN, G, *vshape], dl or None, mn or None) of a tile of a planar / float ref."""
    vs = vshape(qtype)
    if qtype in FLOAT_TYPES:
        src = D.Source(grp, (n_a or vs[0],) + tuple(vs[1:]))
        v = 0
        for i, ax in enumerate(src.ax):
            stride = 1
            for n in vs[i + 1:]:
                stride *= n
            v = v + (ax + (a0 if i == 0 else 0)) * stride
        return w_ref[rows * k_in + src.grp * P.GROUP + v].astype(jnp.float32), None, None
    src = RefSource(w_ref, rows, P.layout(qtype, k_in), grp, vs, tables, a0, n_a)
    c = D.DECODERS[qtype](src)
    return D.code_f32(c), c.dl, c.mn


def row_update(f, dl, mn, xm):
    """One activation row's contribution of a tile: f [BN, G, *vs] codes, xm [G, *vs] -> float32 [BN, G]."""
    p = f * xm[None]
    nd = p.ndim
    if dl is None:
        return jnp.sum(p, axis=tuple(range(2, nd)))
    red = tuple(a for a in range(2, nd) if dl.shape[a] == 1)
    t = dl * jnp.sum(p, axis=red, keepdims=True)
    if mn is not None:
        t = t + mn * jnp.sum(xm[None], axis=red, keepdims=True)
    return jnp.sum(t, axis=tuple(range(2, nd)))


# --- the plane path: formats whose codes are bit planes of 2, 4 or 8 bits (no tables, no sign bits) ---
#
# A code is moved into the mantissa of 1.0 instead of being shifted down and converted: for a ``b``-bit code at
# bit ``p`` (p + b <= 16) of a half word, ``bitcast(ONE | (h & mask)) - 1 == u * 2**(p - 23)`` exactly; the
# activations are prepared once per call (`plane_inputs`: each value scaled by ``2**(23 - p)`` of its code's
# position, exact, and laid out by code position; sums of 16 values for the offsets and minima) or, under
# ``STRATA_QMATMUL_PLANE_X=raw``, scaled as each program loads them (`_RawX`: one FMUL per loaded value), so the
# product is ``u * x`` rounded once, as the shifted form gives. A loop step costs per value one LOP3 and one FADD,
# and one FFMA per row; a thread keeps whole words, so the sums inside a scale unit stay in its registers.
# ``PLANES[qtype]``: (region, bits, weight of the plane's code in ``u``) per plane; ``u = sum(weight * code)``.
PLANES = {
    Q.Q8_0: (("q8", 8, 1),), Q.Q4_0: (("q4", 4, 1),), Q.Q4_1: (("q4", 4, 1),), Q.Q2_K: (("q2", 2, 1),),
    Q.Q4_K: (("q4", 4, 1),), Q.Q6_K: (("q4", 4, 1), ("q2", 2, 16)),
}
# The formats that take the plane path by default: those it made faster on the H200 (2026-12-04, sweep_kernels,
# DEFAULT config: Q4_K gate+up 8960x1536 13.86 -> 10.98 us at 1 row, 61.8 -> 42.7 at 8; Flash-Next's Q2_K expert
# gate+up 15.5 -> 11.2 and 53.2 -> 37.1; its Q4_0 expert down 7.32 -> 7.13 and 26.1 -> 27.0). Slower there, so
# on the decoder path unless STRATA_QMATMUL_PLANES=all: Q6_K's two planes (head 142 -> 164 us at 1 row, 336 -> 817
# at 8) and Q8_0 (the shared expert's down 2560x640: 2.07 -> 2.23 us). Q4_1: not measured (no shipped file has it).
PLANES_DEFAULT = frozenset(PLANES) - {Q.Q6_K, Q.Q8_0}
_XOR = {Q.Q8_0: 0x80808080}   # the q8 plane stores int8 codes; the decoder's u is the byte with its top bit flipped
_ONE = 0x3F800000


def uses_planes(qtype) -> bool:
    """Whether the GEMV takes the plane path for this format: `PLANES_DEFAULT` (``STRATA_QMATMUL_PLANES=1``, the
    default), every format of `PLANES` (``all``) or none (``0``: the decoder path, for comparisons).

    Raises:
      UnsupportedError: another value of ``STRATA_QMATMUL_PLANES``."""
    mode = dispatch.env_choice("STRATA_QMATMUL_PLANES", "1", ("0", "1", "all"))
    return qtype in (PLANES_DEFAULT if mode == "1" else PLANES if mode == "all" else ())


def plane_bits(qtype) -> tuple:
    """The distinct plane widths of a plane-path format, in `plane_inputs` order."""
    return tuple(sorted({b for _, b, _ in PLANES[qtype]}, reverse=True))


def plane_x_mode() -> str:
    """Where the plane path scales and lays out its activations: ``prepared`` (`plane_inputs`, XLA ops before
    the launch) or ``raw`` (``STRATA_QMATMUL_PLANE_X=raw``: the kernel reads x as it is and scales each load; no
    launch before the GEMV at 1, 2, 4 or 8 rows, where x needs no padding). Both give the same GEMV bits: the
    scaling is by powers of two and the sums of 16 take `exact.pairwise_sum`'s order.

    Raises:
      UnsupportedError: another value of ``STRATA_QMATMUL_PLANE_X``."""
    return dispatch.env_choice("STRATA_QMATMUL_PLANE_X", "prepared", ("prepared", "raw"))


def _plane_scale(bits: int, nn: int) -> float:
    """The power of two `plane_inputs` scales value ``nn`` of a word of ``bits``-bit codes by."""
    return 2.0 ** (23 - bits * (nn % (16 // bits)))


def plane_inputs(x, qtype):
    """The plane path's activations: x float32 [..., K] -> (per plane width b of `plane_bits`: float32
    [..., 32 / b, K / 32, b], value ``32 g + a * 32 / b + n`` of the group at [n, g, a], scaled by ``2 ** (23 -
    b * (n mod 16 / b))``; the sums of each 16 values, float32 [..., K / 16]). Plain XLA ops: the GEMVs that read
    one activation share them."""
    x = x.astype(jnp.float32)
    lead, K = x.shape[:-1], x.shape[-1]
    outs = []
    for b in plane_bits(qtype):
        per_word = 32 // b
        xb = jnp.moveaxis(x.reshape(*lead, K // 32, b, per_word), -1, -3)          # [..., 32/b, K/32, b]
        scale = np.asarray([_plane_scale(b, n) for n in range(per_word)], np.float32)
        outs.append(xb * scale.reshape(per_word, 1, 1))
    # elementwise adds (a fixed pairwise tree), not a reduce: XLA fuses them with the planes into one launch
    outs.append(exact.pairwise_sum(x.reshape(*lead, K // 16, 16), -1)[..., 0])
    return tuple(outs)


class _UnitSource(D.Source):
    """A decoder's view for the plane path's scales: one value axis, ``ax[0]`` the format's first value axis at
    values ``v0`` (int32 [1, 1, n]) of each group; the decoder's codes are not used (dead code)."""

    def __init__(self, w_ref, rows, lay, grp, v0, vs, tables):
        super().__init__(grp, (v0.shape[-1],))
        self.ax = [v0 // math.prod(vs[1:])]
        self.w_ref, self.rows, self.lay, self.tables = w_ref, rows, lay, tables

    words = RefSource.words
    table = RefSource.table


def _unit_scales(qtype, w_ref, rows, lay, grp, v0, tables):
    """(dl, mn - dl * off or None) of the scale units holding values ``v0`` of each group: float32
    broadcastable to [BN, G, n]."""
    c = D.DECODERS[qtype](_UnitSource(w_ref, rows, lay, grp, v0, D.VSHAPE[qtype], tables))
    mn = c.mn
    if c.off:
        mn = -(c.dl * jnp.float32(c.off)) if mn is None else mn - c.dl * jnp.float32(c.off)
    return c.dl, mn


class _PreparedX:
    """Row m's `plane_inputs`, side by side in one flat array from word ``base``, input i at ``offs[i]``."""

    def __init__(self, x_ref, base, offs, widths, k_in):
        self.x_ref, self.base, self.offs, self.widths, self.k_in = x_ref, base, offs, widths, k_in

    def plane(self, bits, nn, gi, ai):
        """int32 gi [G, 1], ai [1, bits] -> float32 [G, bits]: value ``32 gi + ai * 32 / bits + nn``, scaled."""
        off = self.offs[self.widths.index(bits)]
        return self.x_ref[self.base + off + (nn * (self.k_in // 32) + gi) * bits + ai]

    def sums16(self, gi):
        """int32 gi [G, 1] -> float32 [G, 2]: the sums of values 0..15 and 16..31 of each group."""
        return self.x_ref[self.base + self.offs[-1] + gi * 2 + lax.broadcasted_iota(jnp.int32, (1, 2), 1)]


class _RawX:
    """Row m's activations as they are (flat, from word ``base``): `_PreparedX`'s values, scaled per load."""

    def __init__(self, x_ref, base):
        self.x_ref, self.base = x_ref, base

    def plane(self, bits, nn, gi, ai):
        v = self.x_ref[self.base + gi * 32 + ai * (32 // bits) + nn].astype(jnp.float32)
        return v * jnp.float32(_plane_scale(bits, nn))

    def sums16(self, gi):
        h = self.base + gi * 32 + lax.broadcasted_iota(jnp.int32, (1, 2), 1) * 16
        xs = [self.x_ref[h + t].astype(jnp.float32) for t in range(16)]
        # exact.pairwise_sum's tree, over separate loads: it slices an array, which a Triton kernel cannot do to
        # values in registers
        while len(xs) > 1:
            n = len(xs) // 2
            xs = [xs[t] + xs[t + n] for t in range(n)]
        return xs[0]


def plane_step(qtype, w_ref, rows, k_in, c, G, xq, tables):
    """One loop step of the plane path: per activation row m, float32 [BN, G] = the sum over each of the
    step's G groups of ``w * x_m``. ``rows``: int32 [BN, 1, 1] (`tile_rows`); ``xq[m]``: row m's activations
    (`_PreparedX` or `_RawX`)."""
    lay = P.layout(qtype, k_in)
    BN = rows.shape[0]
    g0 = c * G
    grp3 = g0 + lax.broadcasted_iota(jnp.int32, (1, G, 1), 1)
    gi = g0 + lax.broadcasted_iota(jnp.int32, (G, 1), 0)
    outs = [None] * len(xq)

    def add(m, u):
        outs[m] = u if outs[m] is None else outs[m] + u

    for region, bits, weight in PLANES[qtype]:
        per_word, per_half = 32 // bits, 16 // bits
        a = lax.broadcasted_iota(jnp.int32, (1, 1, bits), 2)    # word of the group (a group = ``bits`` words)
        ai = lax.broadcasted_iota(jnp.int32, (1, bits), 1)
        wd = w_ref[rows * lay.row_words + lay.offsets[region] + grp3 * bits + a]     # uint32 [BN, G, bits]
        if qtype in _XOR:
            wd = wd ^ jnp.uint32(_XOR[qtype])
        for h, hw in enumerate((wd, wd >> 16)):
            dl, _ = _unit_scales(qtype, w_ref, rows, lay, grp3, a * per_word + h * per_half, tables)
            if weight != 1:
                dl = dl * jnp.float32(weight)
            fs = [lax.bitcast_convert_type((hw & jnp.uint32(((1 << bits) - 1) << (bits * n))) | jnp.uint32(_ONE),
                                           jnp.float32) - 1.0 for n in range(per_half)]
            for m, xm in enumerate(xq):
                t = None
                for n in range(per_half):
                    nn = h * per_half + n
                    xv = xm.plane(bits, nn, gi, ai)                                   # [G, bits]
                    p = fs[n] * xv[None]
                    t = p if t is None else t + p
                add(m, jnp.sum(dl * t, axis=2))
    u16 = lax.broadcasted_iota(jnp.int32, (1, 1, 2), 2)
    _, mn = _unit_scales(qtype, w_ref, rows, lay, grp3, u16 * 16, tables)
    if mn is not None:
        for m, xm in enumerate(xq):
            xs = xm.sums16(gi)                                                        # [G, 2]
            add(m, jnp.sum(mn * xs[None], axis=2))
    return [jnp.broadcast_to(o, (BN, G)) for o in outs]


def _kernel(slot_ref, *refs, n_mats, qtype, M, n_out, k_in, G, cps, n_chunks, masked, BN, x_per_slot,
            table_names, x_sizes, planes, x_offs=(), raw_x=False):
    w_refs = refs[:n_mats]
    n_x = len(x_sizes)
    x_refs = refs[n_mats:n_mats + n_x]
    x_ref = x_refs[0]
    tables = dict(zip(table_names, refs[n_mats + n_x:n_mats + n_x + len(table_names)]))
    o_refs = refs[n_mats + n_x + len(table_names):]
    i = pl.program_id(0)
    s = pl.program_id(1)
    u = pl.program_id(2)
    e = slot_ref[u]            # which stacked matrix this program reads (-1: an unused slot, skipped)
    xu = u if x_per_slot else 0
    nd = 3 if planes else 2 + len(vshape(qtype))

    @pl.when(e >= 0)
    def _():
        rows = tile_rows(i, e, BN, n_out, nd)

        def body(j, accs):
            c, live = split_step(s, j, cps, n_chunks, masked)
            grp = c * G + lax.broadcasted_iota(jnp.int32, (G,), 0)
            if planes and raw_x:    # x as it is, flat [U, M, K]
                xs = [_RawX(x_ref, (xu * M + m) * k_in) for m in range(M)]
            elif planes:            # `plane_inputs` side by side in one flat [U, M, n] array
                xs = [_PreparedX(x_ref, (xu * M + m) * x_sizes[0], x_offs, plane_bits(qtype), k_in)
                      for m in range(M)]
            else:
                xs = [x_ref[xu, m, pl.ds(c * G, G)].astype(jnp.float32) for m in range(M)]  # [G, *vshape] each
            out = []
            for w_ref, acc in zip(w_refs, accs):
                if planes:
                    ts = plane_step(qtype, w_ref, rows, k_in, c, G, xs, tables)
                else:
                    f, dl, mn = decode_tile(qtype, w_ref, rows, grp, k_in, tables)
                    ts = [row_update(f, dl, mn, xs[m]) for m in range(M)]
                for m in range(M):
                    out.append(acc[m] + (jnp.where(live, ts[m], 0.0) if masked else ts[m]))
            return tuple(tuple(out[a * M:(a + 1) * M]) for a in range(n_mats))

        zero = tuple(jnp.zeros((BN, G), jnp.float32) for _ in range(M))
        accs = lax.fori_loop(0, cps, body, tuple(zero for _ in range(n_mats)))
        for o_ref, acc in zip(o_refs, accs):
            for m in range(M):
                o_ref[u, s, pl.ds(i * BN, BN), m] = jnp.sum(acc[m], axis=1)


def _m_run(M: int, interpret: bool) -> int:
    if interpret:
        return M_MAX
    return 1 << max(0, (M - 1).bit_length())


def grouped_gemv(x, w_stacked, slot_expert, qtype, n_out: int, k_in: int, *, interpret: bool,
                 cfg: Config | None = None, split_units: int = 1):
    """For each slot u: x (or x[u]) [M, K] times the matrix ``w_stacked[slot_expert[u]]`` [n_out, K]^T.

    Args:
      x: [M, K] (the same rows for every slot) or [U, M, K]; M <= 8; float32 / bfloat16 / float16.
      w_stacked: [E, n_out, row_words] uint32 planar, or [E, n_out, K] float for F32 / F16 / BF16; or a tuple of
        such stacks of one format and shape (e.g. the experts' gate and up), read by the same programs, which
        share the activation loads and one launch.
      slot_expert: int32 [U]: the matrix each slot reads, or -1 for an unused slot (its output is not written).
      split_units: the slot count the K split is sized for (`tiling`'s ``per_unit``), a constant of the call site,
        never U: U grows with the rows (8-row groups, an expert union over M rows), and a K split that followed it
        would change the summation order, so a row's bits, with the row count. 1 for dense weights; the experts
        per token (top-k) for routed experts, so a decode step's tiling is the one measured.
    Returns: float32 [U, M, n_out] (a tuple of them for a tuple of stacks; each the bits of its own call). Each
    matrix a slot names is read once; rows never mix. Not jitted.
    """
    fused = isinstance(w_stacked, (tuple, list))
    stacks = tuple(w_stacked) if fused else (w_stacked,)
    x_per_slot = x.ndim == 3
    U_in = slot_expert.shape[0]
    slot_expert = slot_expert.astype(jnp.int32)
    if interpret and U_in < 2:
        # Interpret mode inlines the grid loop into XLA, which folds a grid of one program into straight-line
        # code that rounds differently from the same program inside the loop: an idle second slot keeps the loop.
        slot_expert = jnp.concatenate([slot_expert, jnp.full((1,), -1, jnp.int32)])
        if x_per_slot:
            x = jnp.concatenate([x, x[:1]])
    U = slot_expert.shape[0]
    M_in = x.shape[-2]
    M = _m_run(M_in, interpret)
    if M_in < M:
        pad = [(0, 0)] * x.ndim
        pad[-2] = (0, M - M_in)
        x = jnp.pad(x, pad)
    cfg = cfg or choose_config(qtype, n_out, k_in)
    t = tiling(qtype, n_out, k_in, cfg, per_unit=split_units)
    vs = vshape(qtype)
    names = D.TABLES.get(qtype, ())
    tabs = [jnp.asarray(D.table(n)) for n in names]
    U_x = x.shape[0] if x_per_slot else 1
    planes = uses_planes(qtype)
    x_offs = ()
    raw_x = planes and plane_x_mode() == "raw"
    if raw_x:
        xr = (x.reshape(-1),)
        x_sizes = (k_in,)
    elif planes:
        # one array (a concatenate XLA fuses with the ops that compute its pieces): one launch before the GEMV
        # instead of a transpose and a reduce (2026-12-04b, 1.5B steps HLO: 7 of a layer's ~20 launches)
        xp = [a.reshape(U_x * M, -1) for a in plane_inputs(x, qtype)]
        widths = [a.shape[1] for a in xp]
        x_offs = tuple(int(o) for o in np.cumsum([0] + widths[:-1]))
        xr = (jnp.concatenate(xp, axis=1).reshape(-1),)
        x_sizes = (sum(widths),)
    else:
        xr = (x.reshape(U_x, M, k_in // P.GROUP, *vs),)
        x_sizes = (k_in,)
    n_pad = t["n_tiles"] * cfg.BN
    full = pl.no_block_spec
    n_mats = len(stacks)
    call = dispatch.pallas_call(
        functools.partial(_kernel, n_mats=n_mats, qtype=qtype, M=M, n_out=n_out, k_in=k_in, G=t["G"],
                          cps=t["cps"], n_chunks=t["n_chunks"], masked=t["masked"], BN=cfg.BN,
                          x_per_slot=x_per_slot, table_names=names, x_sizes=x_sizes, planes=planes,
                          x_offs=x_offs, raw_x=raw_x),
        out_shape=[jax.ShapeDtypeStruct((U, t["split"], n_pad, M), jnp.float32)] * n_mats,
        grid=(t["n_tiles"], t["split"], U), in_specs=[full] * (1 + n_mats + len(xr) + len(tabs)),
        out_specs=[full] * n_mats,
        interpret=interpret, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        name=f"qmatmul_planar_{getattr(qtype, 'name', qtype)}" + (f"_x{n_mats}" if fused else "") + cfg.tag)
    parts = call(slot_expert, *(w.reshape(-1) for w in stacks), *xr, *tabs)
    outs = []
    for part in parts:
        out = part[:, 0]
        for j in range(1, t["split"]):  # fixed order: row-independent
            out = out + part[:, j]
        outs.append(jnp.swapaxes(out[:U_in, :n_out, :M_in], 1, 2))
    return tuple(outs) if fused else outs[0]


def gemv(x, w, qtype, n_out: int, k_in: int, *, interpret: bool, cfg: Config | None = None):
    """x [M, K] times one weight [n_out, K]^T -> float32 [M, n_out]; M <= 8, or any M as 8-row groups in one
    launch (the weight read once per group), each row with the instructions of the row alone. ``w`` a tuple of
    weights of one format and shape: a tuple of outputs from one launch (`grouped_gemv`'s tuple of stacks, each
    output the bits of its own call). Not jitted."""
    M = x.shape[0]
    fused = isinstance(w, (tuple, list))
    w1 = tuple(wi[None] for wi in w) if fused else w[None]
    if M <= M_MAX:
        y = grouped_gemv(x, w1, jnp.zeros((1,), jnp.int32), qtype, n_out, k_in, interpret=interpret, cfg=cfg)
        return tuple(yi[0] for yi in y) if fused else y[0]
    G = -(-M // M_MAX)
    xg = jnp.pad(x, [(0, G * M_MAX - M), (0, 0)]).reshape(G, M_MAX, k_in)
    y = grouped_gemv(xg, w1, jnp.zeros((G,), jnp.int32), qtype, n_out, k_in, interpret=interpret, cfg=cfg)
    ys = y if fused else (y,)
    out = tuple(yi.reshape(G * M_MAX, n_out)[:M] for yi in ys)
    return out if fused else out[0]
