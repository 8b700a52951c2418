"""The engine: a loaded model on its stages, per-slot state, and the calls that move a sequence forward.

API (the shape of JetStream's engine): `Engine.prefill` reads a prompt into a slot and returns the first pick
(`Engine.start_prefill` gives the same read as a `PromptRead`, one chunk per step, for callers that interleave it);
`Engine.window` runs one verify window (T rows per segment, several segments for batch slots) through every stage;
`Engine.commit` advances the slots by their kept rows; `Engine.run_stage` / `Engine.commit_stage` do the same for one
stage (pipelined groups launch them in their own order; `run` and `commit` are loops over them). The solo loop
(`strata_jax.pipeline.solo.generate`: plain decoding, or speculative with a proposer from `strata_jax.proposers`) and
the batch scheduler (`strata_jax.pipeline.scheduler`) drive these calls.

Beside the engine, in their own modules: the MTP draft chain (`strata_jax.pipeline.mtp_chain`, ``engine.mtp``),
qwen4exp's host-side PLE state (`strata_jax.pipeline.ple_host`, ``engine.ple``) and the memory report
(`strata_jax.pipeline.memory`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.config import ModelConfig
from strata_jax.errors import StrataError
from strata_jax.gguf import open_gguf
from strata_jax.layers.linear import blocks_as_f32, load_progress
from strata_jax.limits import DECODE_STEPS_GPU, PREFILL_CHUNK, PREFILL_CHUNK_GPU, PREFILL_CHUNK_STEP
from strata_jax.models.registry import check_stages, family_of
from strata_jax.pipeline.memory import memory_bytes
from strata_jax.pipeline.mtp_chain import MtpChain
from strata_jax.pipeline.ple_host import PleHost
from strata_jax.pipeline.stages import (Stage, build_commit_fn, build_reset_fn, build_stage_fn, build_steps_fn,
                                       make_stage, parse_layer_split)
from strata_jax.pipeline.windows import CompileCache
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows

log = logging.getLogger("strata_jax")


def check_prefill_chunk(chunk, max_context: int) -> int:
    """``chunk`` as an int when it is a valid prefill chunk: a positive multiple of `PREFILL_CHUNK_STEP` up to
    ``max_context``, or the default `PREFILL_CHUNK` whatever the context (on a shorter one its chunk is padded, as
    a short prompt's is: a chosen size past the context is refused as a mistake, the default must not be).

    Raises:
      StrataError: one line naming the flag, otherwise.
    """
    try:
        c = int(chunk)
    except (TypeError, ValueError):
        c = 0
    if c != chunk or c <= 0 or c % PREFILL_CHUNK_STEP or (c > max_context and c != PREFILL_CHUNK):
        raise StrataError(f"--prefill_chunk {chunk}: must be a positive multiple of {PREFILL_CHUNK_STEP} up to "
                          f"--max_context {max_context} (or the default {PREFILL_CHUNK})")
    return c


def check_decode_steps(n) -> int:
    """``n`` as an int when it is a valid count of decode steps per program (`Engine.run_steps`): an integer >= 1
    (not a bool, a float or a string).

    Raises:
      StrataError: one line naming the flag, otherwise.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise StrataError(f"--decode_steps {n!r}: must be an integer >= 1")
    return int(n)


def default_prefill_chunk(device, max_context: int) -> int:
    """The prefill chunk when none is chosen: `PREFILL_CHUNK_GPU` (512) rows on a GPU whose context holds them
    (measured faster there from 512-token prompts up), else `PREFILL_CHUNK` (128: a CPU, where a padded chunk of
    a short prompt costs its full rows)."""
    return PREFILL_CHUNK_GPU if device.platform == "gpu" and max_context >= PREFILL_CHUNK_GPU else PREFILL_CHUNK


def _ple_on_device(choice: str, ple, device) -> bool:
    """`Engine`'s ``ple_table`` choice for this table and device (see its docstring)."""
    if choice not in ("auto", "host", "device"):
        raise StrataError(f"ple_table {choice!r}: expected auto, host or device")
    if choice != "auto":
        return choice == "device"
    if device.platform != "gpu":
        return False
    try:
        st = device.memory_stats() or {}
    except Exception:  # no statistics on this backend: keep the table on the host
        return False
    free = st.get("bytes_limit", 0) - st.get("bytes_in_use", 0)
    return free >= 1.25 * ple.table.raw.nbytes


def default_decode_steps(device) -> int:
    """Plain decode steps per device program when none is chosen (`Engine.run_steps`): `DECODE_STEPS_GPU` on a GPU,
    where a one-step program is host-bound (its launch takes longer than its kernels), 1 on a CPU (compute-bound:
    nothing to save, and tokens stream one by one)."""
    return DECODE_STEPS_GPU if device.platform == "gpu" else 1


@dataclasses.dataclass
class WindowResult:
    """What the host learns from a window: picks [B, T] and keep counts [B] (numpy), plus device arrays."""

    picks: np.ndarray
    n_keep: np.ndarray
    device_out: dict
    pending: list


class PromptRead:
    """A prompt being read into one slot, one chunk of ``engine.prefill_chunk`` rows per `step` (made by
    `Engine.start_prefill`).

    The chunks, their [1, C] shapes and their order do not depend on who steps the read (`Engine.prefill` in one
    go, or the batch scheduler between other slots' windows), so the slot ends in the same state bit for bit.

    Attributes:
      slot, ids (list[int]), start (position of ``ids[0]``), chunk (rows per chunk, C), read (prompt tokens read
      so far), n_chunks (chunks in all), chunks_read (chunks read so far), pick (int: the pick after the last
      prompt token, set by the last `step`; None before), on_chunk (None, or ``on_chunk(read, len(ids))`` called
      after each chunk's pick has been read: a progress line).
    """

    def __init__(self, engine: "Engine", slot: int, ids: list[int], sampling: SamplingParams, start: int,
                 all_logits: bool, on_chunk: Callable[[int, int], None] | None = None):
        self.engine = engine
        self.on_chunk = on_chunk
        self.slot, self.ids, self.start = int(slot), ids, int(start)
        self.chunk = int(engine.prefill_chunk)
        self.n_chunks = -(-len(ids) // self.chunk)
        self.read = self.chunks_read = 0
        self.pick: int | None = None
        self._samp = RowSampling.make([sampling])
        self._all_logits = all_logits
        self._logits: list[np.ndarray] = []

    @property
    def done(self) -> bool:
        """Every chunk has been read (`pick` is set)."""
        return self.pick is not None

    def step(self) -> bool:
        """Read the next chunk through every stage and wait for its pick (with ``all_logits`` also its logits);
        after the last chunk `pick` is set. Returns `done`.

        Raises:
          StrataError: the prompt is already read.
        """
        if self.done:
            raise StrataError(f"slot {self.slot}: the prompt is already read")
        eng, ids, C, c0 = self.engine, self.ids, self.chunk, self.read
        n = len(ids)
        chunk = ids[c0:c0 + C]
        toks = np.zeros((1, C), np.int32)
        toks[0, :len(chunk)] = chunk
        rows = Rows.make([self.slot], [self.start + c0], [len(chunk)])
        out, _ = eng.run("prefill", toks, rows, self._samp, logits="all" if self._all_logits else "last")
        last = c0 + C >= n
        if self._all_logits:
            self._logits.append(np.asarray(out["logits"][0, :len(chunk)]))
        # one host read per chunk, even where only the last pick is used: chunks chained with no wait between them
        # deadlocked XLA:CPU on a layer split over host devices (a 4-chunk read on 2 stages never finished)
        # a host read of the whole array: indexing the device array would dispatch a program
        pick = int(np.asarray(out["picks"])[0, len(chunk) - 1 if self._all_logits else 0])
        if eng.mtp.active:  # the MTP layer reads the prompt too: row i with the token at i + 1
            nxt = np.zeros((1, C), np.int32)
            follow = list(ids[c0 + 1:c0 + C + 1]) if not last else list(ids[c0 + 1:]) + [pick]
            nxt[0, :len(follow)] = follow
            eng.mtp.after("prefill", out, jax.device_put(rows, eng.stages[-1].device), nxt)
        self.read = min(n, c0 + C)
        self.chunks_read += 1
        if last:
            self.pick = pick
        if self.on_chunk is not None:
            self.on_chunk(self.read, n)
        return self.done

    def logits(self) -> np.ndarray | None:
        """The prompt's logits [len(ids), V] float32 once read with ``all_logits``, else None."""
        return np.concatenate(self._logits) if self._all_logits and self.done else None


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
      prefill_chunk: rows per prefill chunk (`check_prefill_chunk`: a positive multiple of 16 up to
        ``max_context``, or `PREFILL_CHUNK`); None = `default_prefill_chunk` (512 on a GPU, 128 on a CPU). Each
        chunk size is its own compiled prefill program; a prompt
        is read in [1, prefill_chunk] chunks, the last one padded. Models with GDN layers solve the delta rule in
        64-row pieces inside a chunk (`strata_jax.pallas.gdn.reference.CHUNK`): a chunk that is not a multiple of
        64 is padded with rows that leave the state unchanged there (the same result, the padded rows' work wasted).
      ple_table: where qwen4exp's PLE table is gathered from: ``"host"`` (the memory map; each step's rows go up
        with it), ``"device"`` (a copy on the PLE stage's device, 28.8 GB at full size: a loop of decode steps on
        the device gathers its own rows, `run_steps`), ``"auto"``: device on a GPU whose free memory holds it with
        a quarter to spare, else host. Ignored by other families.

    Attributes:
      cfg, family, gguf, stages, states (per stage, its state pytree on its device), cache (`CompileCache` of every
      jitted call: stage windows, commits, slot resets, the MTP chain), n_slots, max_context, weights, kv_dtype,
      load_seconds; ple (`PleHost`, qwen4exp only, else None); mtp (`MtpChain`); prefill_chunk (rows per prefill
      chunk: every read of a prompt started after it is set uses it, so a test may lower it on an engine to make a
      short prompt span several chunks, for its solo reference and its batch run alike; setting it checks it as
      the argument is checked).

    Raises:
      StrataError: bad file, unsupported architecture or block format, bad split, context too large, unknown
        ``weights``, a bad ``prefill_chunk`` (before any weights load).
    """

    def __init__(self, model_path, *, max_context: int = 4096, n_slots: int = 1, layer_split: str | None = None,
                 devices=None, kv_dtype=jnp.float32, compile_cache_size: int = 32, progress: bool = False,
                 weights: str = "auto", prefill_chunk: int | None = None, ple_table: str = "auto"):
        t0 = time.perf_counter()
        # a path, or an already open GGUF-like object (e.g. strata_jax.testing.random_weights.VirtualGGUF)
        self.gguf = model_path if hasattr(model_path, "tensors") else open_gguf(model_path)
        self.family = family_of(self.gguf)  # general.architecture -> its family (strata_jax.models.registry)
        self.cfg: ModelConfig = self.family.read_config(self.gguf)
        if max_context < 2:
            raise StrataError(f"--max_context {max_context}: must be at least 2")
        self.max_context = int(max_context)
        devices = list(devices) if devices is not None else jax.devices()
        self.prefill_chunk = default_prefill_chunk(devices[0], max_context) if prefill_chunk is None else prefill_chunk
        self.n_slots = int(n_slots)
        ranges = parse_layer_split(layer_split, self.cfg.n_layer, len(devices))
        self.weights = _resolve_weights(weights, self.gguf, devices[:len(ranges)])
        self.stages: list[Stage] = []
        check_stages(self.gguf, self.cfg, ranges)  # every tensor against the metadata before any is placed
        bar = _load_bar(self.gguf, self.cfg, len(ranges), self.weights, progress)
        for i, (a, b) in enumerate(ranges):
            with blocks_as_f32(self.weights == "f32"), (load_progress(bar.update) if bar else contextlib.nullcontext()):
                module = self.family.stage(self.gguf, self.cfg, a, b, devices[i])
            self.stages.append(make_stage(module, i, devices[i]))
        self.kv_dtype = kv_dtype
        self.states = [jax.device_put(s.module.init_state(self.n_slots, self.max_context, kv_dtype), s.device)
                       for s in self.stages]
        self.cache = CompileCache(compile_cache_size)
        self.ple = PleHost.for_stages(self.gguf, self.cfg, self.stages, self.n_slots)  # qwen4exp, else None
        if self.ple is not None and _ple_on_device(ple_table, self.ple, self.stages[self.ple.stage].device):
            self.ple.place(self.stages[self.ple.stage].device, self.cfg.vocab_size,
                           progress=bar.update if bar else None)  # the table's bytes are in the bar's total
        if bar:
            bar.close()
        self.mtp = MtpChain(self)  # the MTP draft chain, off until `MtpChain.enable`
        self.load_seconds = time.perf_counter() - t0
        self._tokenizer = None

    # ---- facts -------------------------------------------------------------------------------------------------
    @property
    def prefill_chunk(self) -> int:
        """Rows per prefill chunk (see the class docstring)."""
        return self._prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, chunk: int) -> None:
        self._prefill_chunk = check_prefill_chunk(chunk, self.max_context)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from strata_jax.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_gguf(self.gguf)
        return self._tokenizer

    # ---- running stages ----------------------------------------------------------------------------------------
    def run_stage(self, index: int, kind: str, x, rows: Rows, tokens, sampling: RowSampling, logits: str = "all"):
        """Launch ONE stage for one window, without waiting for it (JAX dispatch is asynchronous).

        Args:
          index: stage index.
          kind: ``window``, ``step`` or ``prefill`` (see `build_stage_fn`).
          x: int32 [B, T] token ids for stage 0 (host, or a device array: the previous step's picks), else the
            previous stage's ``out["hidden"]`` [B, T, D] (moved to this stage's device here).
          rows, sampling: the window's layout and per-segment sampler settings.
          tokens: int32 [B, T] the window's tokens (the last stage's acceptance needs them).
          logits: ``all`` (every row's logits and picks) or ``last`` (each segment's last valid row: prefill).

        Returns:
          (out, pending): ``out["hidden"]`` for the next stage; on the last stage also ``picks`` [B, T] and
          ``n_keep`` [B] (device arrays, not read here); ``pending`` for `commit_stage` (None for step/prefill).
          On the last stage the MTP chain, when active, is launched after the stage (not for prefill chunks:
          `prefill` launches it with the prompt's next tokens).
        """
        fn, args = self._stage_call(index, kind, x, rows, tokens, sampling, logits)
        out, self.states[index], pending = fn(*args)
        if self.stages[index].last and self.mtp.active and kind != "prefill":
            self.mtp.after(kind, out, args[3])
        return out, pending

    def _stage_call(self, index: int, kind: str, x, rows: Rows, tokens, sampling: RowSampling, logits: str):
        """The jitted function of `run_stage` (from the compile cache) and its arguments, placed on the stage (the
        params as ``stage.leaves``)."""
        stage = self.stages[index]
        B, T = tokens.shape
        fn = self.cache.get((index, kind, B, T, logits, self.n_slots),
                            lambda: build_stage_fn(stage, kind, self.max_context, logits))
        dev = stage.device
        extra = None
        if self.ple is not None and index == self.ple.stage:
            extra = {"ple": _place(self.ple.rows_for(kind, tokens, rows), dev)}  # (a device table's rows: moved)
        rows_d = _place(rows, dev)
        tokens_d = _place(tokens, dev, commit=True)
        x_d = tokens_d if x is tokens else _place(x, dev, commit=True)
        return fn, (stage.leaves, self.states[index], x_d, rows_d, tokens_d, _place(sampling, dev), extra)

    def stage_hlo(self, index: int, kind: str, tokens, rows: Rows, sampling: RowSampling, logits: str = "all",
                  x=None) -> str:
        """The final HLO text of stage ``index``'s program for this call (compiled as `run_stage` would; nothing
        runs, no state changes): for `strata_jax.pallas.structure.hlo_launches` and profiles. ``x`` defaults to
        ``tokens`` (right for stage 0)."""
        fn, args = self._stage_call(index, kind, tokens if x is None else x, rows, tokens, sampling, logits)
        return fn.lower(*args).compile().as_text()

    @property
    def steps_unavailable(self) -> str:
        """Why `run_steps` cannot run, in words ('' when it can): it needs the whole model in one stage, qwen4exp's
        PLE table (if any) on the device (``ple_table``) and the MTP chain off (it runs after every step)."""
        if len(self.stages) > 1:
            return "the model is split into stages"
        if self.ple is not None and not self.ple.on_device:
            return "the n-gram table is on the host: --ple_table device puts it on the device"
        if self.mtp.active:
            return "the MTP draft chain runs after every step"
        return ""

    @property
    def can_run_steps(self) -> bool:
        """`run_steps` is available (`steps_unavailable` is empty)."""
        return not self.steps_unavailable

    def run_steps(self, token, rows: Rows, sampling: RowSampling, n_steps: int) -> dict:
        """Launch ``n_steps`` plain decode steps as one device program (`build_steps_fn`), without waiting.

        Args:
          token: int32 [B, 1], the first step's input (host, or a previous call's picks on the device).
          rows: the first step's layout (``n_valid`` 1); step i runs at ``pos0 + i``.
          sampling: per-segment sampler settings.
          n_steps: steps in the program (one compiled program per count).

        Returns:
          ``{"picks": int32 [B, n_steps], "last": int32 [B, 1]}`` (device arrays, not read here; with a PLE table
          also ``prev``, kept by `PleHost.set_device_prev`): step i's pick is the input of step i + 1; ``last`` is
          the next call's ``token``.

        Raises:
          StrataError: not `can_run_steps` (the reason: `steps_unavailable`).
        """
        fn, args, slots = self._steps_call(token, rows, sampling, n_steps)
        out, self.states[0] = fn(*args)
        if self.ple is not None:
            self.ple.set_device_prev(slots, out["prev"])
        return out

    def _steps_call(self, token, rows: Rows, sampling: RowSampling, n_steps: int, ahead: bool = False):
        """The jitted steps program of `run_steps` (from the compile cache), its arguments placed on the stage,
        and the slots it runs. With ``ahead``: the program's compile is started in the background instead
        (`CompileCache.ahead`), and the first item is whether it was."""
        why = self.steps_unavailable
        if why:
            raise StrataError(f"several decode steps per call: not available ({why})")
        stage = self.stages[0]
        B = int(np.shape(token)[0])
        ids = self.ple.ids if self.ple is not None else None
        key = self.steps_key(B, n_steps)
        build = lambda: build_steps_fn(stage, int(n_steps), self.max_context, ids)  # noqa: E731
        dev = stage.device
        slots = np.asarray(rows.slot).tolist()
        ple = self.ple.device_inputs(slots) if ids is not None else None
        args = (stage.leaves, self.states[0], _place(token, dev, commit=True), _place(rows, dev),
                _place(sampling, dev), ple)
        if ahead:
            return self.cache.ahead(key, build, args), args, slots
        return self.cache.get(key, build), args, slots

    def steps_key(self, B: int, n_steps: int) -> tuple:
        """The compile cache's key of `run_steps`' program for B rows."""
        return (0, "steps", int(B), int(n_steps), self.n_slots)

    def compile_steps_ahead(self, slots: list[int], sampling: RowSampling, n_steps: int) -> bool:
        """Start compiling `run_steps`' program for one row on each of ``slots`` (B = ``len(slots)`` rows) in a
        background thread (`CompileCache.ahead`), so that it compiles while something else does: the prompt's
        prefill (the solo path), the other programs of strata-serve's warm-up. The first `run_steps` with B rows
        runs that program (waiting for it if it is not done). The arguments are those `run_steps` is given (a token
        [B, 1] placed on the stage, host `Rows`, ``sampling``, whose ``all_greedy`` is part of the program: the
        rows' settings must be greedy or not as the first call's are). Returns whether a compile was started: not
        when the program is built or started already, or `run_steps` is not available."""
        if not self.can_run_steps:
            return False
        B = len(slots)
        if self.steps_key(B, n_steps) in self.cache:
            return False   # built or started: no device work for the arguments
        started, _, _ = self._steps_call(np.zeros((B, 1), np.int32), Rows.make(slots, [0] * B, [1] * B), sampling,
                                         n_steps, ahead=True)
        return started

    def steps_hlo(self, token, rows: Rows, sampling: RowSampling, n_steps: int) -> str:
        """The final HLO text of `run_steps`' program for this call (compiled, nothing run), as `stage_hlo`."""
        fn, args, _ = self._steps_call(token, rows, sampling, n_steps)
        return fn.lower(*args).compile().as_text()

    def run(self, kind: str, tokens, rows: Rows, sampling: RowSampling, logits: str = "all"):
        """Run ``tokens`` int32 [B, T] through every stage (`run_stage` on each in turn, the hidden rows handed
        on); returns (the last stage's out, pending per stage)."""
        x, out, pendings = tokens, None, []
        for i in range(len(self.stages)):
            out, pending = self.run_stage(i, kind, x, rows, tokens, sampling, logits)
            pendings.append(pending)
            x = out["hidden"]
        return out, pendings

    def commit_stage(self, index: int, rows: Rows, pending, keep) -> None:
        """Advance each segment's slot on stage ``index`` by ``keep[b]`` rows (int [B]: numpy, or a device array,
        possibly on another stage's device: it is copied device to device, no host round trip; the stage holding
        qwen4exp's PLE layer reads it back for its host state). No-op when ``pending`` is None."""
        if pending is None:
            return
        if self.ple is not None and index == self.ple.stage:
            self.ple.commit(rows, jax.device_get(keep))
        stage = self.stages[index]
        shapes = tuple(x.shape for x in jax.tree.leaves(pending))
        fn = self.cache.get((index, "commit", shapes, self.n_slots), lambda: build_commit_fn(stage))
        if not isinstance(keep, jax.Array):
            keep = np.asarray(keep, np.int32)
        self.states[index] = fn(stage.leaves, self.states[index], pending, _place(rows, stage.device),
                                _place(keep, stage.device, commit=True))

    def commit(self, rows: Rows, pendings: list, keep) -> None:
        """Advance each segment's slot by ``keep[b]`` kept rows on every stage (`commit_stage` on each)."""
        for i, pending in enumerate(pendings):
            self.commit_stage(i, rows, pending, keep)

    def prefill(self, slot: int, ids: list[int], sampling: SamplingParams, *, start: int = 0,
                all_logits: bool = False,
                on_chunk: Callable[[int, int], None] | None = None) -> tuple[int, np.ndarray | None]:
        """Read ``ids`` into ``slot`` at positions ``start..`` in chunks of ``self.prefill_chunk`` rows: a
        `PromptRead` (`start_prefill`) run to its end; ``on_chunk(read, len(ids))`` after each chunk (progress).

        Returns:
          (the pick after the last prompt token, the prompt's logits [len(ids), V] float32 if ``all_logits``).

        Raises:
          StrataError: the prompt does not fit in the context.
        """
        read = self.start_prefill(slot, ids, sampling, start=start, all_logits=all_logits, on_chunk=on_chunk)
        while not read.done:
            read.step()
        return read.pick, read.logits()

    def start_prefill(self, slot: int, ids: list[int], sampling: SamplingParams, *, start: int = 0,
                      all_logits: bool = False,
                      on_chunk: Callable[[int, int], None] | None = None) -> "PromptRead":
        """Begin reading ``ids`` into ``slot`` at positions ``start..``: checks the length and, for a new sequence
        (``start`` 0), zeroes the slot; nothing is launched until `PromptRead.step` (``on_chunk``: see
        `PromptRead`). The batch scheduler steps it
        between other slots' decode windows (they never touch this slot's cells); `prefill` steps it to the end.

        Raises:
          StrataError: an empty prompt, or one that does not fit in the context.
        """
        n = len(ids)
        if n == 0:
            raise StrataError("empty prompt")
        if start + n >= self.max_context:
            raise StrataError(f"prompt of {n} tokens does not fit in --max_context {self.max_context} "
                              f"(it needs at least {start + n + 1})")
        if start == 0:
            self.reset_slot(slot)  # a new sequence: recurrent state from zero (K/V cells are overwritten)
        return PromptRead(self, slot, list(ids), sampling, start, all_logits, on_chunk)

    def window(self, tokens: np.ndarray, rows: Rows, sampling: RowSampling, kind: str = "window") -> WindowResult:
        """One verify window for B segments of T rows; the host reads picks and keep counts."""
        out, pendings = self.run(kind, tokens, rows, sampling)
        picks, n_keep = jax.device_get((out["picks"], out["n_keep"]))
        return WindowResult(np.asarray(picks), np.asarray(n_keep), out, pendings)

    # ---- slots ---------------------------------------------------------------------------------------------------
    def reset_slot(self, slot: int) -> None:
        """Zero one slot's state on every stage (recurrent state must start from zero before a new prompt; K/V
        cells are overwritten anyway) and put its PLE predecessors at the sequence start. Other slots' entries are
        untouched, bit for bit."""
        if not 0 <= slot < self.n_slots:
            raise StrataError(f"slot {slot}: the engine has {self.n_slots} slots")
        if self.ple is not None:
            self.ple.reset_slot(slot)
        for i, stage in enumerate(self.stages):
            fn = self.cache.get((i, "reset", self.n_slots),
                                lambda: build_reset_fn(stage, self.max_context, self.kv_dtype))
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
        if self.ple is not None:
            self.ple.reset(n_slots)
        self.mtp.resize(n_slots)


def _place(x, device, commit: bool = False):
    """``x`` (an array or a pytree of arrays) ready for a jitted call on ``device``.

    Host (numpy) leaves and uncommitted device arrays are left to the call, which places them itself (on the device
    of its committed arguments: the stage's params and state) for a fraction of the host time of a
    `jax.device_put`; a tree with an array committed to another device (the previous stage's hidden rows, the last
    stage's picks) is moved. With ``commit``, a tree with host leaves or uncommitted arrays is put on the device
    too: jit compiles a
    function once per kind of argument (a host array and a committed array are two XLA programs), so an argument
    that is sometimes a device array (the token ids: a step's pick fed back; a keep count left on the device) must
    always be one."""
    for leaf in jax.tree.leaves(x):
        if isinstance(leaf, jax.Array) and leaf.committed:
            if leaf.sharding.device_set != {device}:
                return jax.device_put(x, device)
        elif commit:
            return jax.device_put(x, device)
    return x


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
    ram = memory_bytes()
    return "f32" if ram is not None and 4 * n_values <= F32_RAM_FRACTION * ram else "blocks"


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
