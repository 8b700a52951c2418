"""Rotary position embeddings (Su et al. 2021, RoFormer), in ggml's two pairings.

- ``neox=True`` (half-split, HF ``rotate_half``): dims (i, i + d/2) form a pair; qwen2, gemma3, the hybrids.
- ``neox=False`` (adjacent pairs, ggml "normal" mode): dims (2i, 2i+1) form a pair; llama GGUFs, whose Q/K rows
  the converter permuted so that this equals HF's rotate_half on the original weights.

Only the first ``rope_dim`` dims of a head rotate (partial RoPE); the rest pass through. Frequencies are
``theta ** (-2i / rope_dim)``, angles ``position * freq`` in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, rope_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotation angles.

    Args:
      positions: int32 [...] absolute positions.
      rope_dim: rotated dims (even).
      theta: base.

    Returns:
      (cos, sin), each float32 [..., rope_dim // 2].
    """
    inv = 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))
    ang = positions.astype(jnp.float32)[..., None] * inv
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, positions: jax.Array, rope_dim: int, theta: float, neox: bool) -> jax.Array:
    """Rotate the first ``rope_dim`` dims of each head.

    Args:
      x: float32 [..., H, D] (heads on the second-to-last axis).
      positions: int32 [...] (the leading axes of x).
      rope_dim, theta, neox: see the module docstring.

    Returns:
      float32 [..., H, D].
    """
    cos, sin = rope_angles(positions, rope_dim, theta)
    cos, sin = cos[..., None, :], sin[..., None, :]
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    if neox:
        half = rope_dim // 2
        a, b = rot[..., :half], rot[..., half:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rot.shape)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
