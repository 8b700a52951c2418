"""RMSNorm variants.

Source: Zhang & Sennrich 2019 (RMSNorm); HF transformers ``LlamaRMSNorm`` / ``Qwen3NextRMSNorm``. GGUF files store
the effective scale (llama.cpp's converter folds the +1 of zero-centred norms into the weight), so every norm here
is ``x * rsqrt(mean(x^2) + eps) * w`` computed in float32 by `strata_jax.pallas.rows.rms_norm`: one Pallas
program per row on the kernel path, a fixed pairwise order (`strata_jax.layers.exact`) on the reference path; on
both a row's result does not depend on the other rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.pallas import rows as row_ops


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm over the last axis.

    Args:
      x: [..., D] float32.
      w: [D] float32 scale (already including any +1), [k, D] for x [..., k, D] (one scale per position of the
        second-to-last axis, e.g. per hyper-connection stream), or None for no scale.
      eps: added to the mean square.

    Returns:
      [..., D] float32.
    """
    return row_ops.rms_norm(x, w, eps)


class RMSNorm(nnx.Module):
    """RMSNorm with a stored float32 weight [D] (see `rms_norm`)."""

    def __init__(self, w, eps: float):
        self.w = nnx.Param(jnp.asarray(w, jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.w[...], self.eps)

    def add_norm(self, x: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(``x + r``, the norm of it), float32 [..., D] each: a residual add and this norm in one launch on the
        kernel path (`strata_jax.pallas.rows.add_rms_norm`; the same bits as the add and `__call__`)."""
        return row_ops.add_rms_norm(x, r, self.w[...], self.eps)
