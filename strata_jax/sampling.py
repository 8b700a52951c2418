"""Token picks on the device: greedy, or sampled with a draw keyed by (seed, position).

Chain (llama.cpp's order): top_k -> top_p -> min_p -> temperature -> inverse-CDF pick. The candidates are the
`TOP_K_MAX` most likely tokens of each row (`jax.lax.top_k` of a fixed width, so one compiled sampler serves every
k); top_k lies in 1..TOP_K_MAX, and 0 means 64, the default of the C++ engine Strata, whose sampler stops at 64
(so any k up to 64 picks as Strata's does). Widening the candidates to the whole vocabulary would cost a sort of
its 50k-260k logits per sampled row (measured on a CPU: 30 ms per row for 49k, 126 ms for 262k; 1024 candidates:
0.7-2 ms). top_p and min_p act on the temperature-1 probabilities of the kept candidates; min_p keeps tokens with
p >= min_p * p_max. Greedy when temperature <= 0 (argmax, ties to the lower id). Whether every row of a call is
greedy is known on the host (`RowSampling.all_greedy`, a static field: part of the jitted call's cache key), so a
greedy call's program holds the argmax alone: on the H200 the candidate sampler inside a 1.5B-shape step program
(even behind a `jax.lax.cond` that skips it) made the step compile in ~90 s instead of ~11 s (2026-12-02,
experiments/compile_probe.py).

The uniform of the draw is ``jax.random.uniform(fold_in(key(seed), counter))`` with ``counter`` the absolute
position of the row's *input* token (the token at position n+1 is drawn with counter n). A seed therefore gives the
same tokens whatever the window size, acceptance or batch packing, given identical logits; a draft is accepted only
if it equals the sampled token (exact-match verification, not rejection sampling).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from strata_jax.limits import TOP_K_DEFAULT, TOP_K_MAX
from strata_jax.pallas import rows


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampler settings (host side).

    Attributes: temperature (<= 0: greedy), top_k (1..TOP_K_MAX; 0 = 64), top_p (1.0 = off), min_p (0 = off), seed
    (0..SEED_MAX; `RowSampling.make` keeps the low 32 bits of any other, so the command line refuses them).
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@struct.dataclass
class RowSampling:
    """Sampler settings per row (float32/int32/uint32 [R]): host numpy arrays from `make` (a jitted call places
    them on its device), device arrays where a call moved them. ``all_greedy`` (static, not traced): every row has
    temperature <= 0, so `pick_tokens` compiles to an argmax alone."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array
    all_greedy: bool = struct.field(pytree_node=False, default=False)

    @staticmethod
    def make(params: list[SamplingParams]) -> "RowSampling":
        return RowSampling(
            np.array([p.temperature for p in params], np.float32),
            np.array([p.top_k for p in params], np.int32),
            np.array([p.top_p for p in params], np.float32),
            np.array([p.min_p for p in params], np.float32),
            np.array([p.seed & 0xFFFFFFFF for p in params], np.uint32),
            all_greedy=all(p.greedy for p in params),
        )


def _pick_rows(logits, temperature, top_k, top_p, min_p, seed, counter):
    """int32 [R]: the pick of each row of logits float32 [R, V] (the chain of the module docstring)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    kmax = min(TOP_K_MAX, logits.shape[-1])
    vals, idx = jax.lax.top_k(logits, kmax)
    k = jnp.where(top_k <= 0, min(TOP_K_DEFAULT, kmax), jnp.minimum(top_k, kmax))[:, None]
    keep = jnp.arange(kmax)[None, :] < k
    # rows.softmax: a row-invariant kernel on a GPU (the reference's pairwise tree made this program compile for
    # ~30 s per softmax there), the fixed-order reference on a CPU
    p = rows.softmax(jnp.where(keep, vals, -jnp.inf))
    keep = keep & ((jnp.cumsum(p, axis=-1) - p) < top_p[:, None])
    keep = keep & (p >= min_p[:, None] * p[:, :1])
    keep = keep.at[:, 0].set(True)
    t = jnp.maximum(temperature, 1e-6)[:, None]
    q = rows.softmax(jnp.where(keep, vals / t, -jnp.inf))
    u = jax.vmap(lambda s, c: jax.random.uniform(jax.random.fold_in(jax.random.key(s), c), (), jnp.float32))(
        seed, counter)
    c = jnp.cumsum(q, axis=-1)
    choice = jnp.minimum(jnp.sum(c < u[:, None] * c[:, -1:], axis=-1), jnp.sum(keep, axis=-1) - 1)
    sampled = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature <= 0.0, greedy, sampled)


def pick_tokens(logits: jax.Array, sampling: RowSampling, counters: jax.Array) -> jax.Array:
    """Pick one token per row.

    Args:
      logits: float32 [R, V].
      sampling: per-row settings (arrays [R]).
      counters: int32 [R], the absolute position of each row's input token.

    Returns:
      int32 [R] token ids.
    """
    logits = logits.astype(jnp.float32)
    if sampling.all_greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return _pick_rows(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.seed,
                      counters.astype(jnp.uint32))
