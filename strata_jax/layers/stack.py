"""Runs of identical layers, their parameters stacked on a leading axis and applied with `jax.lax.scan`.

A 30-layer model unrolled is 30 copies of the layer in the XLA program; a scan compiles the layer once, which cuts
compile time by about the number of layers. `group_runs` splits a stage's layers into maximal runs of consecutive
layers with the same structure (same weight shapes and block formats, same static attributes); each run becomes
one `LayerRun`. Per-layer facts that differ inside a run (a sliding window, a RoPE base) must be stored as arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class LayerRun(nnx.Module):
    """``n`` consecutive layers held as one module whose parameters have a leading layer axis.

    Args:
      layers: modules with identical graph structure (checked by `group_runs`).
    """

    def __init__(self, layers: list):
        first = layers[0]
        if len(layers) > 1:
            states = [nnx.split(m)[1] for m in layers]
            stacked = jax.tree.map(_stack_and_free, *states)
        else:
            stacked = jax.tree.map(lambda x: x[None], nnx.split(first)[1])
        nnx.update(first, stacked)
        self.layer = first
        self.n = len(layers)

    def scan(self, fn, carry, xs=None):
        """``fn(layer, carry, i, x) -> (carry, y)`` for each layer i of the run (``x`` = ``xs[i]``).

        Returns:
          (final carry, stacked ys).
        """
        gd, st = nnx.split(self.layer)

        def body(c, inp):
            st_i, i, x = inp
            return fn(nnx.merge(gd, st_i), c, i, x)

        return jax.lax.scan(body, carry, (st, jnp.arange(self.n, dtype=jnp.int32), xs))


def _stack_and_free(*xs):
    """``jnp.stack(xs)``, then free the per-layer device buffers (the stacked copy replaces them), so that building a
    stage peaks at its weights plus one stacked tensor, not twice its weights (53.6 GB of full-size Qwen3.8 weights
    did not fit twice on an H200). A buffer that appears in more than one layer is kept."""
    out = jnp.stack(xs)
    if len({id(x) for x in xs}) == len(xs):
        for x in xs:
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
    return out


def group_runs(layers: list) -> list[LayerRun]:
    """Split ``layers`` into maximal runs of consecutive structurally identical modules."""
    runs, cur, cur_gd = [], [], None
    for m in layers:
        gd = nnx.split(m)[0]
        if cur and gd != cur_gd:
            runs.append(LayerRun(cur))
            cur = []
        if not cur:
            cur_gd = gd
        cur.append(m)
    if cur:
        runs.append(LayerRun(cur))
    return runs
