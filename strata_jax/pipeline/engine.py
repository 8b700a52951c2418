"""The engine: a loaded model on its stages, per-slot state, and the calls that move a sequence forward.

API (the shape of JetStream's engine): `Engine.prefill` reads a prompt into a slot and returns the first pick;
`Engine.window` runs one verify window (T rows per segment, several segments for batch slots) through every stage;
`Engine.commit` advances the slots by their kept rows; `Engine.generate` is the solo loop on top (plain decoding
or speculative with a proposer, `strata_jax.proposers`). The batch scheduler (`strata_jax.pipeline.scheduler`) drives
the same calls in its own order.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.config import ModelConfig, config_from_gguf
from strata_jax.errors import StrataError
from strata_jax.gguf import open_gguf
from strata_jax.models import build_stage
from strata_jax.pipeline.stages import (Stage, build_commit_fn, build_stage_fn, make_stage, parse_layer_split)
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
      model_path: a GGUF file.
      max_context: cells per slot (prompt + generated tokens).
      n_slots: slots of state (1 for the solo path).
      layer_split: ``"K1,K2,..."`` or None (see `parse_layer_split`).
      devices: devices to place stages on (default: ``jax.devices()``).
      kv_dtype: K/V cache dtype (float32 or bfloat16).
      compile_cache_size: most compiled functions kept.
      progress: show a progress line while loading.

    Raises:
      StrataError: bad file, unsupported architecture or block format, bad split, context too large.
    """

    def __init__(self, model_path, *, max_context: int = 4096, n_slots: int = 1, layer_split: str | None = None,
                 devices=None, kv_dtype=jnp.float32, compile_cache_size: int = 32, progress: bool = False):
        t0 = time.perf_counter()
        self.gguf = open_gguf(model_path)
        self.cfg: ModelConfig = config_from_gguf(self.gguf)
        if max_context < 2:
            raise StrataError(f"--max_context {max_context}: must be at least 2")
        self.max_context = int(max_context)
        self.n_slots = int(n_slots)
        devices = list(devices) if devices is not None else jax.devices()
        ranges = parse_layer_split(layer_split, self.cfg.n_layer, len(devices))
        self.stages: list[Stage] = []
        bar = _load_bar(len(ranges), progress)
        for i, (a, b) in enumerate(ranges):
            module = build_stage(self.gguf, self.cfg, a, b, devices[i])
            self.stages.append(make_stage(module, i, devices[i]))
            if bar:
                bar.update(1)
        if bar:
            bar.close()
        self.kv_dtype = kv_dtype
        self.states = [jax.device_put(s.module.init_state(self.n_slots, self.max_context, kv_dtype), s.device)
                       for s in self.stages]
        self.cache = CompileCache(compile_cache_size)
        self._commit_fns = {}
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
                                                        jax.device_put(sampling, stage.device))
            pendings.append(pending)
            x = out["hidden"]
        return out, pendings

    def commit(self, rows: Rows, pendings: list, keep) -> None:
        """Advance each segment's slot by ``keep[b]`` kept rows on every stage (a device array or numpy [B])."""
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
        return pick, (np.concatenate(logits_out) if all_logits else None)

    def window(self, tokens: np.ndarray, rows: Rows, sampling: RowSampling, kind: str = "window") -> WindowResult:
        """One verify window for B segments of T rows; the host reads picks and keep counts."""
        out, pendings = self.run(kind, tokens, rows, sampling)
        picks, n_keep = jax.device_get((out["picks"], out["n_keep"]))
        return WindowResult(np.asarray(picks), np.asarray(n_keep), out, pendings)


def _load_bar(n: int, progress: bool):
    if not progress:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=n, desc="loading stages", unit="stage", file=sys.stderr, leave=False)
