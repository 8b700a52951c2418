"""The engine: a loaded model on its stages, per-slot state, and the calls that move a sequence forward.

API (the shape of JetStream's engine): `Engine.prefill` reads a prompt into a slot and returns the first pick;
`Engine.window` runs one verify window (T rows per segment, several segments for batch slots) through every stage;
`Engine.commit` advances the slots by their kept rows; `Engine.generate` is the solo loop on top (plain decoding
or speculative with a proposer, `strata_jax.proposers`). The batch scheduler (`strata_jax.pipeline.scheduler`) drives
the same calls in its own order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time


import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.config import ModelConfig
from strata_jax.errors import StrataError
from strata_jax.gguf import open_gguf
from strata_jax.layers.linear import blocks_as_f32, load_progress
from strata_jax.models.registry import check_stages, family_of, mtp_head
from strata_jax.pipeline.stages import (Stage, build_commit_fn, build_mtp_fn, build_stage_fn, make_stage,
                                       parse_layer_split)
from strata_jax.pipeline.windows import CompileCache
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows, tree_bytes

log = logging.getLogger("strata_jax")

MAX_WINDOW = 8
PREFILL_CHUNK = 128


@dataclasses.dataclass
class WindowResult:
    """What the host learns from a window: picks [B, T] and keep counts [B] (numpy), plus device arrays."""

    picks: np.ndarray
    n_keep: np.ndarray
    device_out: dict
    pending: list


class Engine:
    """A model loaded on one or more devices, with ``n_slots`` slots of state.

    Args:
      model_path: a GGUF file, or an open GGUF-like object (`strata_jax.testing.random_weights.VirtualGGUF`).
      max_context: cells per slot (prompt + generated tokens).
      n_slots: slots of state (1 for the solo path).
      layer_split: ``"K1,K2,..."`` or None (see `parse_layer_split`).
      devices: devices to place stages on (default: ``jax.devices()``).
      kv_dtype: K/V cache dtype (float32 or bfloat16).
      compile_cache_size: most compiled functions kept.
      progress: show a progress line while loading.
      weights: ``"blocks"`` (weights stay in their GGUF block formats, dequantized inside every matmul: what the
        GPU kernels read), ``"f32"`` (block formats dequantized once at load, `strata_jax.layers.linear.blocks_as_f32`:
        the same values, >= 4x the memory, much faster decode with XLA on a CPU), or ``"auto"``: ``"f32"`` when
        every stage is on a CPU and the float32 copy takes at most `F32_RAM_FRACTION` of the machine's memory (the
        cgroup's limit when lower), else ``"blocks"``. The choice is in ``self.weights``.

    Raises:
      StrataError: bad file, unsupported architecture or block format, bad split, context too large, unknown
        ``weights``.
    """

    def __init__(self, model_path, *, max_context: int = 4096, n_slots: int = 1, layer_split: str | None = None,
                 devices=None, kv_dtype=jnp.float32, compile_cache_size: int = 32, progress: bool = False,
                 weights: str = "auto"):
        t0 = time.perf_counter()
        # a path, or an already open GGUF-like object (e.g. strata_jax.testing.random_weights.VirtualGGUF)
        self.gguf = model_path if hasattr(model_path, "tensors") else open_gguf(model_path)
        self.family = family_of(self.gguf)  # general.architecture -> its family (strata_jax.models.registry)
        self.cfg: ModelConfig = self.family.read_config(self.gguf)
        if max_context < 2:
            raise StrataError(f"--max_context {max_context}: must be at least 2")
        self.max_context = int(max_context)
        self.n_slots = int(n_slots)
        devices = list(devices) if devices is not None else jax.devices()
        ranges = parse_layer_split(layer_split, self.cfg.n_layer, len(devices))
        self.weights = _resolve_weights(weights, self.gguf, devices[:len(ranges)])
        check_stages(self.gguf, self.cfg, ranges)  # every tensor against the metadata before any is placed
        self.stages: list[Stage] = []
        bar = _load_bar(self.gguf, self.cfg, len(ranges), self.weights, progress)
        for i, (a, b) in enumerate(ranges):
            with blocks_as_f32(self.weights == "f32"), (load_progress(bar.update) if bar else contextlib.nullcontext()):
                module = self.family.stage(self.gguf, self.cfg, a, b, devices[i])
            self.stages.append(make_stage(module, i, devices[i]))
        if bar:
            bar.close()
        self.kv_dtype = kv_dtype
        self.states = [jax.device_put(s.module.init_state(self.n_slots, self.max_context, kv_dtype), s.device)
                       for s in self.stages]
        self.cache = CompileCache(compile_cache_size)
        # qwen4exp's PLE: the table stays in the host's memory map; each window's rows are gathered here from the
        # slot's committed predecessor ids, which advance only by committed tokens.
        self.ple_table = None
        ple_stage = next((s for s in self.stages if getattr(s.module, "has_ple", False)), None)
        if ple_stage is not None:
            self.ple_table = type(ple_stage.module).ple_table(self.gguf, self.cfg)
            self.ple_stage = ple_stage.index
            self._reset_ple(self.n_slots)
        self._commit_fns = {}
        # the MTP draft layer (off until `enable_mtp`): module, params and per-slot K/V on the last stage's device
        self.mtp = None
        self.mtp_n = 0
        self.mtp_state = None
        self._mtp_last: dict[int, tuple] = {}
        self.load_seconds = time.perf_counter() - t0
        self._tokenizer = None

    # ---- facts -------------------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from strata_jax.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_gguf(self.gguf)
        return self._tokenizer

    def weight_bytes(self) -> int:
        """Bytes of weights held on the devices (in their block formats)."""
        return sum(tree_bytes(s.params) for s in self.stages)

    def state_bytes_per_slot(self) -> list[int]:
        """Bytes of state per slot on each stage."""
        return [tree_bytes(st) // self.n_slots for st in self.states]

    # ---- running stages ----------------------------------------------------------------------------------------
    def _fn(self, stage: Stage, kind: str, B: int, T: int, logits: str):
        key = (stage.index, kind, B, T, logits)
        return self.cache.get(key, lambda: build_stage_fn(stage, kind, self.max_context, logits))

    def run(self, kind: str, tokens: np.ndarray, rows: Rows, sampling: RowSampling, logits: str = "all"):
        """Run ``tokens`` [B, T] through every stage (one jitted call per stage); returns (last stage's out, pending
        per stage). ``kind``: ``window``, ``step`` or ``prefill`` (see `build_stage_fn`)."""
        B, T = tokens.shape
        tok = jnp.asarray(tokens, jnp.int32)
        x = tok
        pendings = []
        out = None
        for stage in self.stages:
            fn = self._fn(stage, kind, B, T, logits)
            x_d = jax.device_put(x, stage.device)
            rows_d = jax.device_put(rows, stage.device)
            out, self.states[stage.index], pending = fn(stage.params, self.states[stage.index], x_d, rows_d,
                                                        jax.device_put(tok, stage.device),
                                                        jax.device_put(sampling, stage.device),
                                                        self._extra(stage, kind, tokens, rows))
            pendings.append(pending)
            x = out["hidden"]
        if self.mtp_active and kind != "prefill":
            self._mtp_after(kind, out, jax.device_put(rows, self.stages[-1].device))
        return out, pendings

    def _extra(self, stage: Stage, kind: str, tokens, rows: Rows):
        """Per-row inputs of a stage besides x: the PLE table rows on the stage that holds the PLE layer. Steps and
        prefill chunks commit every valid row at once, so the slot's predecessors advance here; a verify window's
        predecessors advance in `commit` (or `ple_commit`) by the kept rows only."""
        if self.ple_table is None or stage.index != self.ple_stage:
            return None
        toks = np.asarray(tokens, np.int64)
        slots = np.asarray(rows.slot).tolist()
        n_valid = np.asarray(rows.n_valid).tolist()
        prev = np.stack([self.ple_prev[s] for s in slots])
        rows_bytes = self.ple_table.gather(prev, toks)
        if kind in ("step", "prefill"):
            for b, s in enumerate(slots):
                self.ple_prev[s] = self.ple_table.advance(self.ple_prev[s], toks[b], n_valid[b])
        else:
            self._ple_window[tuple(slots)] = toks
        return {"ple": jax.device_put(rows_bytes, stage.device)}

    def _reset_ple(self, n_slots: int) -> None:
        """qwen4exp: each slot's committed PLE predecessor ids (host side), all at the sequence start."""
        self.ple_prev = [self.ple_table.start_prev() for _ in range(n_slots)]
        self._ple_window = {}

    def ple_commit(self, rows: Rows, keep) -> None:
        """Advance the PLE predecessors of a verify window's slots by their kept rows (host keep counts [B]).
        (On the stage holding the PLE layer this is the one host read of a verdict; other families have none.)"""
        if self.ple_table is None:
            return
        slots = tuple(np.asarray(rows.slot).tolist())
        toks = self._ple_window.pop(slots, None)
        if toks is None:
            return
        keep = np.asarray(keep).tolist()
        for b, s in enumerate(slots):
            self.ple_prev[s] = self.ple_table.advance(self.ple_prev[s], toks[b], int(keep[b]))

    def commit(self, rows: Rows, pendings: list, keep) -> None:
        """Advance each segment's slot by ``keep[b]`` kept rows on every stage (a device array or numpy [B])."""
        if self.ple_table is not None:
            self.ple_commit(rows, jax.device_get(keep))
        keep = jnp.asarray(keep, jnp.int32)
        for stage, pending in zip(self.stages, pendings):
            if pending is None:
                continue
            fn = self._commit_fns.get(stage.index)
            if fn is None:
                fn = self._commit_fns[stage.index] = build_commit_fn(stage)
            self.states[stage.index] = fn(stage.params, self.states[stage.index], pending,
                                          jax.device_put(rows, stage.device), jax.device_put(keep, stage.device))

    def prefill(self, slot: int, ids: list[int], sampling: SamplingParams, *, start: int = 0,
                all_logits: bool = False) -> tuple[int, np.ndarray | None]:
        """Read ``ids`` into ``slot`` at positions ``start..`` in chunks of `PREFILL_CHUNK`.

        Returns:
          (the pick after the last prompt token, the prompt's logits [len(ids), V] float32 if ``all_logits``).

        Raises:
          StrataError: the prompt does not fit in the context.
        """
        n = len(ids)
        if n == 0:
            raise StrataError("empty prompt")
        if start + n >= self.max_context:
            raise StrataError(f"prompt of {n} tokens does not fit in --max_context {self.max_context} "
                              f"(it needs at least {start + n + 1})")
        samp = RowSampling.make([sampling])
        if start == 0:
            self.reset_slot(slot)  # a new sequence: recurrent state from zero (K/V cells are overwritten)
        logits_out = []
        pick = None
        C = PREFILL_CHUNK
        for c0 in range(0, n, C):
            chunk = ids[c0:c0 + C]
            toks = np.zeros((1, C), np.int32)
            toks[0, :len(chunk)] = chunk
            rows = Rows.make([slot], [start + c0], [len(chunk)])
            out, _ = self.run("prefill", toks, rows, samp, logits="all" if all_logits else "last")
            if all_logits:
                logits_out.append(np.asarray(out["logits"][0, :len(chunk)]))
                pick = int(out["picks"][0, len(chunk) - 1])
            else:
                pick = int(out["picks"][0, 0])
            if self.mtp_active:  # the MTP layer reads the prompt too: row i with the token at i + 1
                nxt = np.zeros((1, C), np.int32)
                follow = list(ids[c0 + 1:c0 + C + 1]) if c0 + C < n else list(ids[c0 + 1:]) + [pick]
                nxt[0, :len(follow)] = follow
                self._mtp_after("prefill", out, jax.device_put(rows, self.stages[-1].device), nxt)
        return pick, (np.concatenate(logits_out) if all_logits else None)

    def window(self, tokens: np.ndarray, rows: Rows, sampling: RowSampling, kind: str = "window") -> WindowResult:
        """One verify window for B segments of T rows; the host reads picks and keep counts."""
        out, pendings = self.run(kind, tokens, rows, sampling)
        picks, n_keep = jax.device_get((out["picks"], out["n_keep"]))
        return WindowResult(np.asarray(picks), np.asarray(n_keep), out, pendings)


    # ---- batch slots: one stage at a time, per-stage commits, slot reset, memory (used by pipeline.scheduler) ----
    def run_stage(self, index: int, kind: str, x, rows: Rows, tokens, sampling: RowSampling, logits: str = "all"):
        """Launch ONE stage for one group's window, without waiting for it (JAX dispatch is asynchronous).

        Args:
          index: stage index.
          kind: ``window``, ``step`` or ``prefill`` (see `build_stage_fn`).
          x: int32 [B, T] token ids for stage 0, else the previous stage's ``out["hidden"]`` [B, T, D] (moved to
            this stage's device here with `jax.device_put`).
          rows, sampling: the window's layout and per-segment sampler settings.
          tokens: int32 [B, T] the window's tokens (the last stage's acceptance needs them).

        Returns:
          (out, pending): ``out["hidden"]`` for the next stage; on the last stage also ``picks`` [B, T] and
          ``n_keep`` [B] (device arrays, not read here); ``pending`` for `commit_stage` (None for step/prefill).
        """
        stage = self.stages[index]
        B, T = tokens.shape
        fn = self._fn(stage, kind, B, T, logits)
        dev = stage.device
        out, self.states[index], pending = fn(stage.params, self.states[index], jax.device_put(x, dev),
                                              jax.device_put(rows, dev), jax.device_put(tokens, dev),
                                              jax.device_put(sampling, dev), self._extra(stage, kind, tokens, rows))
        if stage.last and self.mtp_active and kind != "prefill":
            self._mtp_after(kind, out, jax.device_put(rows, dev))
        return out, pending

    def commit_stage(self, index: int, rows: Rows, pending, keep) -> None:
        """Advance each segment's slot on stage ``index`` by ``keep[b]`` rows; ``keep`` may be a device array on
        another stage's device (it is copied device to device, no host round trip). No-op when ``pending`` is None."""
        if pending is None:
            return
        if self.ple_table is not None and index == self.ple_stage:
            self.ple_commit(rows, jax.device_get(keep))
        stage = self.stages[index]
        fn = self._commit_fns.get(stage.index)
        if fn is None:
            fn = self._commit_fns[stage.index] = build_commit_fn(stage)
        self.states[index] = fn(stage.params, self.states[index], pending, jax.device_put(rows, stage.device),
                                jax.device_put(jnp.asarray(keep, jnp.int32), stage.device))

    def reset_slot(self, slot: int) -> None:
        """Zero one slot's state on every stage (recurrent state must start from zero before a new prompt; K/V
        cells are overwritten anyway) and put its PLE predecessors at the sequence start. Other slots' entries are
        untouched, bit for bit."""
        if not 0 <= slot < self.n_slots:
            raise StrataError(f"slot {slot}: the engine has {self.n_slots} slots")
        if self.ple_table is not None:
            self.ple_prev[slot] = self.ple_table.start_prev()
        for i, stage in enumerate(self.stages):
            fn = self._commit_fns.get(("reset", i))
            if fn is None:
                axes = _slot_axes(stage.module, self.n_slots, self.max_context, self.kv_dtype)

                def reset(state, s, axes=axes):
                    return jax.tree.map(lambda a, ax: a if ax is None else
                                        jax.lax.dynamic_update_index_in_dim(
                                            a, jnp.zeros_like(jax.lax.index_in_dim(a, 0, ax, keepdims=True)),
                                            s, ax), state, axes)

                fn = self._commit_fns[("reset", i)] = jax.jit(reset, donate_argnums=(0,))
            self.states[i] = fn(self.states[i], jnp.int32(slot))

    def set_slots(self, n_slots: int) -> None:
        """Re-create the per-slot state with ``n_slots`` slots on every stage (all slots empty)."""
        n_slots = int(n_slots)
        if n_slots < 1:
            raise StrataError(f"--batch {n_slots}: needs at least 1 slot")
        self.states = None
        self.n_slots = n_slots
        self.states = [jax.device_put(s.module.init_state(n_slots, self.max_context, self.kv_dtype), s.device)
                       for s in self.stages]
        self._commit_fns = {k: v for k, v in self._commit_fns.items() if not isinstance(k, tuple)}
        if self.ple_table is not None:
            self._reset_ple(n_slots)
        if self.mtp is not None:
            self.mtp_state = self.mtp.init_state(n_slots, self.max_context, self.kv_dtype, self.stages[-1].device)
            self._mtp_last = {}

    # ---- MTP proposals (the model's draft layer on the last stage) ----------------------------------------------------
    def enable_mtp(self, n_draft: int) -> None:
        """Load the model's MTP layer on the last stage's device and, from now on, run its catch-up + draft chain
        after every window, step and prefill chunk (`strata_jax.pipeline.stages.build_mtp_fn`): each slot's next
        ``n_draft`` proposals wait on the device for `mtp_proposal`. Idempotent; a larger ``n_draft`` lengthens the
        chain. Enable before the prompts are read (the MTP layer's K/V holds the prompt too).

        Raises:
          StrataError: the model has no MTP layer (``nextn_predict_layers`` = 0) or its tensors are missing;
            UnsupportedError: a family without an MTP layer; ``n_draft`` outside 1..MAX_WINDOW - 1.
        """
        from flax import nnx

        n_draft = int(n_draft)
        if not 1 <= n_draft <= MAX_WINDOW - 1:
            raise StrataError(f"MTP chain of {n_draft} drafts: must lie in 1..{MAX_WINDOW - 1}")
        if self.mtp is None:
            if int(getattr(self.cfg, "n_nextn", 0) or 0) <= 0:
                raise StrataError(f"{self.gguf.path} ({self.cfg.arch}) has no MTP layer (nextn_predict_layers = 0)")
            dev = self.stages[-1].device
            with blocks_as_f32(self.weights == "f32"):
                self.mtp = mtp_head(self.gguf, self.cfg, dev, reuse=self._loaded_on(dev))
            self._mtp_graphdef, self._mtp_params = nnx.split(self.mtp)
            self.mtp_state = self.mtp.init_state(self.n_slots, self.max_context, self.kv_dtype, dev)
        self.mtp_n = max(self.mtp_n, n_draft)

    def _loaded_on(self, device) -> dict:
        """The head and embedding modules the stages already hold on ``device`` (shared with the MTP layer)."""
        got = {}
        for st in self.stages:
            if st.device != device:
                continue
            m = st.module
            if getattr(m, "embed", None) is not None:
                got["token_embd.weight"] = m.embed
            if st.last and not self.cfg.tied_head and getattr(m, "head", None) is not None:
                got["output.weight"] = m.head
        return got

    @property
    def mtp_active(self) -> bool:
        """True while the MTP chain runs after every window (`enable_mtp` / `set_mtp_chain`)."""
        return self.mtp is not None and self.mtp_n > 0

    def set_mtp_chain(self, n_draft: int) -> int:
        """Set the MTP chain to exactly ``n_draft`` drafts (loading the MTP layer on first use), or pause it with 0
        (the layer stays loaded; `mtp_proposal` then returns what the last chain left). For benchmarks that compare
        chain lengths on one engine. Change it between sequences: windows run while the chain is paused are not read
        by the MTP layer, so its later drafts for that sequence are worse (never the output, which the verify
        window decides). Returns the chain length now running (0 for a model without an MTP layer).

        Raises:
          StrataError: ``n_draft`` outside 0..MAX_WINDOW - 1.
        """
        n_draft = int(n_draft)
        if not 0 <= n_draft <= MAX_WINDOW - 1:
            raise StrataError(f"MTP chain of {n_draft} drafts: must lie in 0..{MAX_WINDOW - 1}")
        if n_draft == 0 or int(getattr(self.cfg, "n_nextn", 0) or 0) <= 0:
            self.mtp_n = 0
            return 0
        self.enable_mtp(n_draft)
        self.mtp_n = n_draft
        return n_draft

    def _mtp_after(self, kind: str, out: dict, rows: Rows, next_tokens=None) -> None:
        """Launch the MTP step after the last stage's call (asynchronous; nothing read back here)."""
        h = out["mtp_hidden"]
        B, T = h.shape[:2]
        if kind == "prefill":
            nxt, n_use = jnp.asarray(next_tokens, jnp.int32), rows.n_valid
        else:
            nxt = out["picks"]
            n_use = out["n_keep"] if kind == "window" else rows.n_valid
        mode = "prefill" if kind == "prefill" else "window"
        key = ("mtp", mode, B, T, self.mtp_n)
        fn = self.cache.get(key, lambda: build_mtp_fn(self._mtp_graphdef, mode, self.mtp_n))
        drafts, probs, self.mtp_state = fn(self._mtp_params, self.mtp_state, h, nxt, rows, n_use)
        for b, s in enumerate(np.asarray(jax.device_get(rows.slot)).tolist()):
            self._mtp_last[int(s)] = (drafts, probs, rows.pos0, n_use, b)

    def mtp_proposal(self, slot: int) -> tuple[int, list[int], list[float]] | None:
        """The MTP drafts waiting for ``slot``: (position of the token they follow, drafts, probabilities), or None
        before the slot's first prompt. Reads them from the device (waits for the chain)."""
        got = self._mtp_last.get(int(slot))
        if got is None:
            return None
        drafts, probs, pos0, n_use, b = jax.device_get(got[:4]) + (got[4],)
        pos = int(np.asarray(pos0)[b]) + int(np.asarray(n_use)[b])
        return pos, np.asarray(drafts)[b].tolist(), np.asarray(probs)[b].astype(float).tolist()

    def handoff_bytes_per_row(self) -> int:
        """Bytes handed from one stage to the next per window row (hidden [D] float32)."""
        return 4 * int(self.cfg.n_embd)

    def memory_report(self) -> dict:
        """Bytes per stage: weights, state per slot, hand-off per row; and the device's limit where known.

        Returns:
          {"stages": [{"stage", "layers", "device", "weight_bytes", "slot_bytes", "limit_bytes"|None}, ...],
           "handoff_bytes_per_row": int, "n_slots": int}
        """
        per_slot = self.state_bytes_per_slot()
        stages = []
        for s, sb in zip(self.stages, per_slot):
            stages.append({"stage": s.index, "layers": f"{s.start}..{s.stop - 1}", "device": str(s.device),
                           "weight_bytes": tree_bytes(s.params), "slot_bytes": int(sb),
                           "limit_bytes": _device_limit(s.device)})
        return {"stages": stages, "handoff_bytes_per_row": self.handoff_bytes_per_row(), "n_slots": self.n_slots}

    def memory_lines(self) -> list[str]:
        """The memory report as log lines (printed at start)."""
        r = self.memory_report()
        mib = 1 / 2 ** 20
        out = []
        for st in r["stages"]:
            lim = f", device limit {st['limit_bytes'] * mib:.0f} MiB" if st["limit_bytes"] else ""
            out.append(f"stage {st['stage']} (layers {st['layers']}, {st['device']}): weights "
                       f"{st['weight_bytes'] * mib:.1f} MiB, {st['slot_bytes'] * mib:.2f} MiB per slot{lim}")
        if len(r["stages"]) > 1:
            out.append(f"hand-off: {r['handoff_bytes_per_row']} bytes per row per stage boundary")
        return out

    def slots_that_fit(self, limit_bytes: int | None = None, rows: int = 8) -> int | None:
        """Most slots every stage can hold: (limit - weights - hand-off rows) // bytes per slot, the minimum over
        stages. ``limit_bytes`` per device (``--memory_limit_gib``), else each device's ``memory_stats()`` limit;
        None when no limit is known."""
        best = None
        for st in self.memory_report()["stages"]:
            lim = limit_bytes if limit_bytes is not None else st["limit_bytes"]
            if lim is None:
                continue
            room = int(lim) - st["weight_bytes"] - rows * self.handoff_bytes_per_row()
            n = max(room, 0) // max(st["slot_bytes"], 1)
            best = n if best is None else min(best, n)
        return best

    def check_batch_fits(self, n_slots: int, limit_bytes: int | None = None) -> None:
        """Raise StrataError when ``n_slots`` slots do not fit, saying how many would."""
        n = self.slots_that_fit(limit_bytes)
        if n is not None and n_slots > n:
            per = max(st["slot_bytes"] for st in self.memory_report()["stages"])
            lim = "--memory_limit_gib" if limit_bytes is not None else "the device memory"
            raise StrataError(f"--batch {n_slots} does not fit in {lim}: {per / 2 ** 20:.2f} MiB per slot on the "
                              f"largest stage; {n} slot(s) would fit (or lower --max_context)")


F32_RAM_FRACTION = 0.4
WEIGHTS = ("auto", "blocks", "f32")


def _resolve_weights(weights: str, g, devices) -> str:
    """``"blocks"`` or ``"f32"`` for `Engine`'s ``weights`` argument (see its docstring)."""
    if weights not in WEIGHTS:
        raise StrataError(f"weights={weights!r}: expected one of {', '.join(WEIGHTS)}")
    if weights != "auto":
        return weights
    if getattr(g, "virtual", False) or any(d.platform != "cpu" for d in devices):
        return "blocks"
    n_values = sum(int(np.prod(t.shape)) for t in g.tensors.values())
    ram = _memory_bytes()
    return "f32" if ram is not None and 4 * n_values <= F32_RAM_FRACTION * ram else "blocks"


def _memory_bytes() -> int | None:
    """The memory this process may use: the physical memory, or the cgroup's limit when lower (containers), or
    None when neither can be read."""
    got = []
    try:
        got.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                v = f.read().strip()
            if v.isdigit():
                got.append(int(v))
        except OSError:
            pass
    return min(got) if got else None


def _device_limit(device) -> int | None:
    try:
        ms = device.memory_stats()
    except Exception:
        return None
    if not ms:
        return None
    return int(ms.get("bytes_limit") or 0) or None


def _slot_axes(module, n_slots: int, max_context: int, kv_dtype):
    """Per state leaf, the axis that indexes slots (found by comparing state shapes for 1 and 2 slots)."""
    a = jax.eval_shape(lambda: module.init_state(1, max_context, kv_dtype))
    b = jax.eval_shape(lambda: module.init_state(2, max_context, kv_dtype))

    def ax(x, y):
        d = [i for i, (p, q) in enumerate(zip(x.shape, y.shape)) if p != q]
        return d[0] if d else None

    return jax.tree.map(ax, a, b)


def _load_bar(g, cfg, n_stages: int, weights: str, progress: bool):
    """A progress bar (stderr, a terminal only) over the bytes of the tensors the stages read: every tensor but an
    MTP layer's (blocks at or past ``n_layer``, loaded on demand)."""
    if not progress:
        return None
    import re
    import sys

    from tqdm import tqdm

    def trunk(name):
        m = re.match(r"blk\.(\d+)\.", name)
        return m is None or int(m.group(1)) < cfg.n_layer

    total = sum(int(getattr(t, "nbytes", 0) or 0) for name, t in g.tensors.items() if trunk(name))
    desc = f"loading {'and dequantizing ' if weights == 'f32' else ''}weights" + (
        f" ({n_stages} stages)" if n_stages > 1 else "")
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False,
                disable=None)
