"""Per-sequence state and the row layout of a window.

A *window* is a rectangle of rows ``[B, T]``: B segments, each the rows of one slot at consecutive positions
``pos0[b] .. pos0[b] + T - 1`` (the slot's last accepted token, then its proposals). Only the first ``n_valid[b]``
rows of a segment are real; the rest pad the rectangle. The solo path is ``B = 1``; serial batch windows are one
segment per slot; a pipelined group's window is one segment per slot of the group.

Every state array has a leading slot axis ``[n_slots, ...]``: a segment reads and writes only its slot's entries.
A window writes K/V cells (rejected rows' cells are overwritten before any query can read them) and leaves
recurrent state untouched; ``commit(keep)`` then advances each slot by exactly its kept rows.

The K/V cache keeps one spare cell at index ``max_context``: padded rows and rows past the context end write there,
and no query ever attends it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Rows:
    """Where the rows of a window (or a prefill chunk) live.

    Attributes (int32 arrays: host numpy from `make`, device arrays where a call moved them):
      slot: int32 [B], the slot each segment reads and writes.
      pos0: int32 [B], absolute position of each segment's first row.
      n_valid: int32 [B], real rows per segment (1..T); the others are padding.
    """

    slot: jax.Array
    pos0: jax.Array
    n_valid: jax.Array

    @property
    def B(self) -> int:
        return self.slot.shape[0]

    def positions(self, T: int) -> jax.Array:
        """int32 [B, T] absolute positions."""
        return self.pos0[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]

    def valid(self, T: int) -> jax.Array:
        """bool [B, T]: the row is real."""
        return jnp.arange(T, dtype=jnp.int32)[None, :] < self.n_valid[:, None]

    @staticmethod
    def make(slot, pos0, n_valid) -> "Rows":
        """A layout of host int32 numpy arrays: a jitted call places them on its device itself, several times
        cheaper in host time than a `jax.device_put` (or ``jnp.asarray``) of each per window."""
        return Rows(np.asarray(slot, np.int32), np.asarray(pos0, np.int32), np.asarray(n_valid, np.int32))


def write_cells(cache: jax.Array, rows: Rows, values: jax.Array, max_context: int, layer=None) -> jax.Array:
    """Write one value per row into a per-slot cell cache.

    Args:
      cache: [n_slots, max_context + 1, ...], or [n_layers, n_slots, max_context + 1, ...] with ``layer`` given.
      rows: the window layout.
      values: [B, T, ...] (same trailing shape as the cache cells).
      max_context: cells per slot (the spare cell is index ``max_context``).
      layer: int32 scalar index into the leading layer axis, or None.

    Returns:
      The updated cache. Padded rows and positions >= max_context go to the spare cell.
    """
    B, T = values.shape[:2]
    pos = rows.positions(T)
    ok = rows.valid(T) & (pos < max_context) & (pos >= 0)
    cell = jnp.where(ok, pos, max_context)
    slot = jnp.broadcast_to(rows.slot[:, None], (B, T))
    if cache.dtype == jnp.uint16:  # bfloat16 cells held as their bit patterns (`kv_zeros`)
        values = jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)
    else:
        values = values.astype(cache.dtype)
    if B * T == 1:
        # one cell (a solo decode step): a dynamic_update_slice whose scalar indices XLA computes inside it; the
        # scatter cost an index select and concatenate of their own (H200 step HLO, 2026-12-04b). Same cell
        # (in range either way), same bits.
        lead = () if layer is None else (layer,)
        idx = lead + (slot[0, 0], cell[0, 0]) + (0,) * (cache.ndim - len(lead) - 2)
        return jax.lax.dynamic_update_slice(cache, values.reshape((1,) * (len(lead) + 2) + values.shape[2:]), idx)
    if layer is None:
        return cache.at[slot, cell].set(values)
    return cache.at[layer, slot, cell].set(values)


def kv_zeros(shape, kv_dtype, device=None) -> jax.Array:
    """Zero K/V cells of ``shape`` as a stage on ``device`` (default: the default backend's) holds them: as
    ``kv_dtype``, except bfloat16 on a CPU, held as its uint16 bit patterns.

    Why: XLA:CPU has no bfloat16 in-place update, and its float normalization turns each write of a bfloat16 cache
    into a float32 copy of the whole cache and back (4x slower decode at a 4096-cell context, measured on
    SmolLM2-135M). Integer cells are updated in place; `kv_view` reads them as bfloat16 (a bitcast). The bits held
    are the bfloat16 values'. GPUs update bfloat16 in place and keep bfloat16 cells (their kernels read them).
    """
    platform = device.platform if device is not None else jax.default_backend()
    if jnp.dtype(kv_dtype) == jnp.bfloat16 and platform == "cpu":
        return jnp.zeros(shape, jnp.uint16)
    return jnp.zeros(shape, kv_dtype)


def kv_view(cells: jax.Array) -> jax.Array:
    """K/V cells as their float dtype: uint16 cells (`kv_zeros`) as bfloat16, a bitcast; others unchanged."""
    if cells.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(cells, jnp.bfloat16)
    return cells


def tree_bytes(tree) -> int:
    """Total bytes of the arrays in a pytree (shape-dtype structs count too)."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def slot_bytes(state_shapes, n_slots: int) -> int:
    """Bytes of state one slot costs, given the shapes of a state made for ``n_slots`` slots."""
    return tree_bytes(state_shapes) // max(n_slots, 1)
