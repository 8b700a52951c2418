"""Low-rank gated hyper-connections of qwen4exp (4 residual streams).

Sources: HF transformers 5.24 ``modeling_qwen4_exp.Qwen4ExpTextGatedResidual`` and ``Qwen4ExpTextDecoderLayer``
(the read/write order). GGUF names (llama.cpp ``conversion/qwen4exp.py``): per layer half
``blk.N.hc_{attn,ffn}_{norm,down,up,inject}.weight``; head ``output_hc_{norm,down,up}.weight`` (no inject).

The residual ``R`` is float32 [..., hc, D] (hc streams of width D). A read:
  ``xn = RMSNorm_per_stream(R) * w_norm`` (w_norm [hc*D], +1 folded in by the converter);
  ``lo = silu((W_down xn_flat) / hc)`` [r]; ``m = sigmoid(W_up lo)`` [hc*D] -> [hc, D];
  ``mixed = mean_c(m * xn)`` [D]; ``inj = 2 * sigmoid((W_inject xn_flat) / hc)`` [hc].
A write: ``R[c] += y * inj[c]`` for the block output y [D].
All arithmetic is elementwise or per-row reductions in a fixed order (`strata_jax.layers.exact`), so rows stay
independent (window exactness) given a row-exact `QLinear`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.config import shape_dims
from strata_jax.layers.exact import row_mean
from strata_jax.layers.gdn import qcall, rowwise
from strata_jax.layers.linear import QLinear, load_f32
from strata_jax.layers.norms import rms_norm
from strata_jax.pallas import rows as row_ops


def norm_per_stream(R: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of each stream of R float32 [..., hc, D] separately, times ``w`` [hc*D] (reshaped [hc, D]): one
    launch, the weight applied in the norm's kernel (the same product as after it)."""
    return rms_norm(R, w.reshape(R.shape[-2:]), eps)


def stream_mean(x: jax.Array) -> jax.Array:
    """Mean over the stream axis of x [..., hc, D] -> [..., D], in `row_mean`'s fixed order (row exact)."""
    return row_mean(jnp.swapaxes(x, -1, -2))[..., 0]


@dataclasses.dataclass(frozen=True)
class SigmoidScaled:
    """``sigmoid(v * scale)`` as a hashable elementwise function (`rowwise`'s ``fn``): with ``scale`` ``1 / hc`` for
    a power-of-two ``hc``, the bits of ``sigmoid(v / hc)`` (the product and the quotient are the same exact
    value; XLA itself turns ``/ 4`` into ``* 0.25``), the scaling inside the row map's program instead of an XLA
    multiply fusion before it."""
    scale: float

    def __call__(self, v):
        return jax.nn.sigmoid(v * self.scale)


@dataclasses.dataclass(frozen=True)
class ReadGates:
    """The gates of a hyper-connection read from the one projection ``[W_down; W_inject; 0] xn`` (`rowwise`'s
    ``fn``, hashable): lanes ``< rank``: ``silu(v / hc)`` (the up projection's input); lanes ``rank ..
    rank + hc - 1``: ``2 * sigmoid(v / hc)`` (the inject weights); lanes after: 0 (the zero rows that pad the
    width to the up projection's K). For a power-of-two ``hc`` the division is the product by ``1 / hc`` (the
    same exact value). The lane index comes from an iota over the last axis: the same per-lane code in the row
    map's Pallas program and in the reference's one-row map."""
    rank: int
    hc: int

    def __call__(self, v):
        x = v * (1.0 / self.hc) if self.hc & (self.hc - 1) == 0 else v / self.hc
        sig = jax.nn.sigmoid(x)
        lane = jax.lax.broadcasted_iota(jnp.int32, v.shape, v.ndim - 1)
        return jnp.where(lane < self.rank, x * sig, jnp.where(lane < self.rank + self.hc, 2.0 * sig, 0.0))


class GatedResidual(nnx.Module):
    """One hyper-connection read (see module docstring).

    Args: g; prefix e.g. ``"blk.3.hc_attn_"`` or ``"output_hc_"``; dim: D; hc: streams; rank: r (None: as the
    file's ``down``); eps; inject: has ``inject``. Tensors (expected shapes): ``norm`` [hc*D], ``down`` [r, hc*D],
    ``up`` [hc*D, r], ``inject`` [hc, hc*D]. Where down and inject share a format and up is float-stored, they are
    held as ``down_inject`` [w, hc*D] (down's rows, inject's, zero rows up to w = r + hc rounded up to 32;
    `QLinear.stacked`) and ``up`` [hc*D, w] (zero columns after r; `QLinear.padded_k`), the gates as one
    `ReadGates` row map (``down`` and ``inject`` are then None).
    """

    def __init__(self, g, prefix: str, *, dim: int, hc: int, rank: int | None, eps: float, inject: bool = True,
                 device=None):
        self.hc, self.eps = int(hc), eps
        self.norm_w = nnx.Param(load_f32(g, prefix + "norm.weight", device, shape=(hc * dim,)))
        self.down = QLinear.from_gguf(g, prefix + "down.weight", device, shape=(rank, hc * dim))
        self.up = QLinear.from_gguf(g, prefix + "up.weight", device, shape=(hc * dim, rank or self.down.n_out))
        self.inject = (QLinear.from_gguf(g, prefix + "inject.weight", device, shape=(hc, hc * dim)) if inject
                       else None)
        # down and inject read the same xn: one matrix [W_down; W_inject; 0] of width rounded up to 32 (the planar
        # GEMV's K unit), one row map for both gates (`ReadGates`) and the up projection on that width (zero
        # columns): per read 2 launches fewer (the inject GEMV, and the silu fusion + the inject's slice). Only
        # where up is float-stored (its columns can be padded) and down / inject share a format.
        self.rank = self.down.n_out
        width = -(-(self.rank + hc) // 32) * 32
        up = self.up.padded_k(width) if inject else None
        stacked = QLinear.stacked([self.down, self.inject], n_out=width) if up is not None else None
        self.down_inject = stacked  # assigned once: a QLinear (nnx data) or None
        if stacked is not None:
            self.up = up
            self.down = self.inject = None

    def __call__(self, R: jax.Array, exact: bool):
        """R float32 [B, T, hc, D] -> (mixed [B, T, D], inj [B, T, hc] or None)."""
        return self.mix(norm_per_stream(R, self.norm_w[...], self.eps), exact)

    def after_write(self, R: jax.Array, y: jax.Array, inj: jax.Array, exact: bool):
        """``self(hc_write(R, y, inj), exact)`` with the write and this read's norm in one row program
        (`rows.hc_write_norm`): -> (R after the write, mixed, inj of this read)."""
        R, xn = row_ops.hc_write_norm(R, y, inj, self.norm_w[...], self.eps)
        return (R, *self.mix(xn, exact))

    def mix(self, xn: jax.Array, exact: bool):
        """The read after its norm: xn float32 [B, T, hc, D] (`norm_per_stream` of R) -> (mixed [B, T, D], inj
        [B, T, hc] or None)."""
        B, T, hc, D = xn.shape
        flat = xn.reshape(B, T, hc * D)
        if self.down_inject is not None:
            z = rowwise(ReadGates(self.rank, hc), qcall(self.down_inject, flat, exact), exact)
            m = jax.nn.sigmoid(qcall(self.up, z, exact)).reshape(B, T, hc, D)
            return stream_mean(m * xn), z[..., self.rank:self.rank + hc]
        lo = jax.nn.silu(qcall(self.down, flat, exact) / hc)
        m = jax.nn.sigmoid(qcall(self.up, lo, exact)).reshape(B, T, hc, D)
        mixed = stream_mean(m * xn)
        if self.inject is None:
            return mixed, None
        q = qcall(self.inject, flat, exact)
        if exact and hc & (hc - 1) == 0:  # the / hc in row_map's program: exact (a power of two), one launch less
            return mixed, 2.0 * rowwise(SigmoidScaled(1.0 / hc), q, exact)
        return mixed, 2.0 * rowwise(jax.nn.sigmoid, q / hc, exact)


def hyper_read(g, cfg, prefix: str, device=None, inject: bool = True) -> GatedResidual:
    """The `GatedResidual` at ``prefix`` with ``cfg``'s streams, width, rank and norm epsilon (every qwen4exp read:
    the layers' ``hc_attn_`` / ``hc_ffn_``, the head's ``output_hc_``, the MTP layer's)."""
    d = shape_dims(g, cfg)
    return GatedResidual(g, prefix, dim=d.n_embd, hc=d.hc, rank=d.hc_lowrank, eps=cfg.rms_eps, inject=inject,
                         device=device)


def hc_write(R: jax.Array, y: jax.Array, inj: jax.Array) -> jax.Array:
    """``R[c] += y * inj[c]``: R [B, T, hc, D], y [B, T, D], inj [B, T, hc] -> [B, T, hc, D]."""
    return R + y[..., None, :] * inj[..., :, None]
