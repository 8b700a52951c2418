"""Runs of identical layers, their parameters stacked on a leading axis and applied with `jax.lax.scan`.

A 30-layer model unrolled is 30 copies of the layer in the XLA program; a scan compiles the layer once, which cuts
compile time by about the number of layers. `group_runs` splits a stage's layers into maximal runs of consecutive
layers with the same structure (same weight shapes and block formats, same static attributes); each run becomes
one `LayerRun`. Per-layer facts that differ inside a run (a sliding window, a RoPE base) must be stored as arrays.

On the kernel path (`strata_jax.pallas.dispatch.kernels_in_use`: a GPU, or ``STRATA_PALLAS_IMPL=kernel|interpret``)
every layer is its own run of one (`stack_layers`): a Pallas-Triton call cannot read a dynamic slice of a stacked
array in place, so inside a scan XLA would copy every layer's weights (and its K/V cache, GDN state) for the
kernels at every step; with per-layer buffers the kernels read them where they are and a run of one is applied
without a loop. The cost is compile time: the step holds one copy of the layer per layer (XLA reuses the compiled
kernels and fusions of identical layers, so it grows by less than the layer count). ``STRATA_STACK_LAYERS=1`` /
``0`` forces stacking on / off (read when a stage is built), e.g. to compare the two on a GPU.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.errors import StrataError
from strata_jax.pallas import dispatch


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
        if self.n == 1:  # no loop: the layer's parameters (and the caller's state) are read in place, never sliced
            first = lambda t: jax.tree.map(lambda a: a[0], t)
            c, y = fn(nnx.merge(gd, first(st)), carry, jnp.int32(0), None if xs is None else first(xs))
            return c, jax.tree.map(lambda a: a[None], y)

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
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.is_deleted():
                x.delete()
    return out


def stack_layers() -> bool:
    """Whether `group_runs` stacks identical layers into scanned runs: off on the kernel path (module docstring),
    unless ``STRATA_STACK_LAYERS`` (``1`` / ``0``) says otherwise.

    Raises:
      StrataError: another value of ``STRATA_STACK_LAYERS``.
    """
    env = os.environ.get("STRATA_STACK_LAYERS", "")
    if env in ("1", "0"):
        return env == "1"
    if env:
        raise StrataError(f"STRATA_STACK_LAYERS={env!r}: expected 1 (stack layers into scans) or 0 (one run per "
                          "layer)")
    return not dispatch.kernels_in_use()


def group_runs(layers: list, stack: bool | None = None) -> list[LayerRun]:
    """Split ``layers`` into maximal runs of consecutive structurally identical modules (``stack=False``: one run
    per layer; None: `stack_layers`)."""
    if stack is None:
        stack = stack_layers()
    runs, cur, cur_gd = [], [], None
    for m in layers:
        gd = nnx.split(m)[0]
        if cur and (gd != cur_gd or not stack):
            runs.append(LayerRun(cur))
            cur = []
        if not cur:
            cur_gd = gd
        cur.append(m)
    if cur:
        runs.append(LayerRun(cur))
    return runs
