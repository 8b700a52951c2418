"""qwen4exp's per-layer embeddings (PLE) on the host: the table stays in the file's memory map, and each window's
table rows are gathered here from the slot's committed predecessor ids (SERVING.md §3.2: they advance only by
committed tokens), then handed to the stage that holds the PLE layer as its ``ple`` input.

`PleHost.for_stages` gives None for every other family (they have no host-side per-row inputs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.state import Rows


@functools.partial(jax.jit, donate_argnums=0)
def _write_rows(table, piece, row):
    """``table[row:row + len(piece)] = piece`` in place (the table buffer is donated)."""
    return jax.lax.dynamic_update_slice(table, piece, (row, 0))


class PleHost:
    """Each slot's committed PLE predecessor ids and the gather of a window's table rows.

    Args:
      table: the file's `strata_jax.layers.ple.PLETable` (``type(stage.module).ple_table(g, cfg)``).
      stage: index of the stage holding the PLE layer (the one that takes `rows_for`'s output).
      n_slots: slots of state.

    Attributes:
      table, stage: as given.
      prev: per slot, its last ``ngram - 1`` committed token ids (int64 numpy), EOS-filled at a sequence start.
    """

    def __init__(self, table, stage: int, n_slots: int):
        self.table = table
        self.stage = int(stage)
        self.ids = None  # DeviceRowIds once `place` put the table on the device
        self.raw = None
        self.reset(n_slots)

    # ---- the table on the device (a loop of decode steps gathers its own rows: `device_inputs`) ----------------
    def place(self, device, vocab: int, progress=None, chunk_bytes: int = 1 << 30) -> None:
        """Put the table (uint8 [rows, row_bytes]) and the row-id tables (`DeviceRowIds`) on ``device``.

        A table in host memory (the file's memory map: 28.8 GB for Qwen3.8-Flash-Next) goes up in pieces of about
        ``chunk_bytes``, each written in place into one device buffer (donated), so the device holds the table plus
        one piece at most and the host reads the map once; ``progress(n_bytes)`` is called after each piece (the
        load bar)."""
        from strata_jax.layers.ple import DeviceRowIds

        self.ids = DeviceRowIds(self.table, vocab, device)
        raw = self.table.raw
        step = max(1, int(chunk_bytes) // max(1, raw.shape[1]))
        if isinstance(raw, jax.Array) or raw.shape[0] <= step:
            self.raw = jax.device_put(raw, device)
        else:
            out = jnp.zeros(raw.shape, jnp.uint8, device=device)
            for a in range(0, raw.shape[0], step):
                piece = jax.device_put(np.ascontiguousarray(raw[a:a + step]), device)
                out = _write_rows(out, piece, a)
                if progress is not None:
                    progress(piece.nbytes)
            self.raw = out

    @property
    def on_device(self) -> bool:
        """The table and its row-id tables are on the device (`place` ran): device loops can gather rows."""
        return self.ids is not None

    def device_inputs(self, slots) -> dict:
        """The inputs of a device loop over ``slots``' steps: the tables and each slot's predecessors int32 [B,
        ngram_size - 1] (the device copy a previous loop left, else the host's). When the previous loop ran these
        very slots in this order, its array is passed as it is (no device op per call). ``prev`` is always committed
        to the table's device: jit compiles a program per kind of argument, and a previous loop's is committed."""
        got = [self._dev.get(s) for s in slots]
        arr = got[0][0] if got[0] is not None else None
        if arr is not None and arr.shape[0] == len(slots) and all(
                g is not None and g[0] is arr and g[1] == b for b, g in enumerate(got)):
            prev = arr
        else:
            prev = jax.device_put(jnp.concatenate([g[0][g[1]:g[1] + 1] if g is not None else
                                                   jnp.asarray(self.prev[s][None], jnp.int32)
                                                   for s, g in zip(slots, got)]), self.raw.sharding)
        return {**self.ids.arrays, "raw": self.raw, "prev": prev}

    def set_device_prev(self, slots, prev) -> None:
        """After a device loop: ``slots``' predecessors are the rows of ``prev`` int32 [B, ngram_size - 1] (a device
        array, read back only when the host needs them: `rows_for`, `commit`)."""
        for b, s in enumerate(slots):
            self._dev[s] = (prev, b)

    def _sync(self, slots) -> None:
        for s in slots:
            if s in self._dev:
                arr, b = self._dev.pop(s)
                self.prev[s] = np.asarray(arr)[b].astype(np.int64)

    @classmethod
    def for_stages(cls, g, cfg, stages, n_slots: int) -> "PleHost | None":
        """The PLE host state of a model whose stages hold a PLE layer (``module.has_ple``), else None."""
        st = next((s for s in stages if getattr(s.module, "has_ple", False)), None)
        if st is None:
            return None
        return cls(type(st.module).ple_table(g, cfg), st.index, n_slots)

    def reset(self, n_slots: int) -> None:
        """Every slot at the sequence start (after `Engine.set_slots`)."""
        self.prev = [self.table.start_prev() for _ in range(int(n_slots))]
        self._window: dict[tuple, np.ndarray] = {}
        # slot -> (predecessors a device loop left, int32 [B, ngram_size - 1]; the slot's row in them)
        self._dev: dict[int, tuple[jax.Array, int]] = {}

    def reset_slot(self, slot: int) -> None:
        """One slot at the sequence start (a new prompt)."""
        self.prev[slot] = self.table.start_prev()
        self._dev.pop(slot, None)

    def rows_for(self, kind: str, tokens, rows: Rows):
        """The table rows of a window's tokens, uint8 [B, T, n_heads, row_bytes] (`PLETable.gather`: host numpy,
        or a device array when the table is one).

        Steps and prefill chunks commit every valid row at once, so the slots' predecessors advance here; a verify
        window's advance in `commit` by its kept rows only (its tokens are remembered until then).

        Args:
          kind: ``step``, ``prefill`` or ``window``.
          tokens: int [B, T] the window's token ids (host or device; a device array is read back).
          rows: the window's layout.
        """
        toks = np.asarray(tokens, np.int64)
        slots = np.asarray(rows.slot).tolist()
        self._sync(slots)
        prev = np.stack([self.prev[s] for s in slots])
        got = self.table.gather(prev, toks)
        if kind in ("step", "prefill"):
            for b, (s, n) in enumerate(zip(slots, np.asarray(rows.n_valid).tolist())):
                self.prev[s] = self.table.advance(self.prev[s], toks[b], n)
        else:
            self._window[tuple(slots)] = toks
        return got

    def commit(self, rows: Rows, keep) -> None:
        """Advance the predecessors of a verify window's slots by their kept rows (``keep`` int [B]; a device array
        is read back: on the stage holding the PLE layer this is the one host read of a verdict)."""
        slots = tuple(np.asarray(rows.slot).tolist())
        self._sync(slots)
        toks = self._window.pop(slots, None)
        if toks is None:
            return
        for b, (s, k) in enumerate(zip(slots, np.asarray(keep).tolist())):
            self.prev[s] = self.table.advance(self.prev[s], toks[b], int(k))
