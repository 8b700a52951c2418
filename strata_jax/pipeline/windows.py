"""One jitted function per (stage, kind, row layout), kept in a bounded LRU compile cache.

The key is static: the stage index, the kind of call (``window``, ``step`` = window + commit of every valid row,
``prefill``, ``commit``) and the row layout ``(B, T)``. Each compile is logged with its duration; the count is in the
stats. When the cache is full the least recently used function is dropped (XLA frees its executable). A first call
that runs longer than ``notice_after`` seconds is announced (``notify``) while it compiles, so that a command can
say what it is waiting for (`describe_key`).

`use_persistent_cache` turns on JAX's persistent compilation cache (compiled programs kept on disk and read back by
later runs) and counts its reads and writes with `jax.monitoring` events (`XlaCacheStats`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Hashable

log = logging.getLogger("strata_jax")


class CompileCache:
    """A bounded LRU of compiled functions.

    Args:
      capacity: most functions kept (>= 1).
      notify: ``notify(key, seconds)`` for a first call still running after ``notice_after`` seconds: called with
        ``seconds=None`` then (from a timer thread, while the call compiles) and with its total seconds when it
        ends. None: silent. May be set after construction.
      notice_after: seconds before a first call is announced.

    Attributes:
      compiles: functions built so far (including rebuilt evictions).
      compile_seconds: total seconds spent in first calls (trace + compile + first run; for a function compiled
        `ahead`, the wait for that compile and the first run).
      ahead_started: `ahead` compiles started.
      ahead_used: functions of ``compiles`` whose program an `ahead` compile started (their first call was fetched).
    """

    def __init__(self, capacity: int = 32, notify: Callable | None = None, notice_after: float = 1.0):
        if capacity < 1:
            raise ValueError("compile cache capacity must be >= 1")
        self.capacity = capacity
        self._fns: collections.OrderedDict[Hashable, Callable] = collections.OrderedDict()
        self.compiles = 0
        self.compile_seconds = 0.0
        self.evictions = 0
        self.notify = notify
        self.notice_after = float(notice_after)
        self._generation = 0  # bumped by `clear`: a first call begun before it does not store its function
        self._ahead: dict[Hashable, tuple] = {}  # key -> (thread, jitted) of `ahead` compiles not yet called
        self.ahead_started = 0   # `ahead` compiles started
        self.ahead_used = 0      # of them, fetched by `get` (counted in compiles)

    def ahead(self, key: Hashable, build: Callable[[], Callable], args: tuple) -> bool:
        """Start compiling the function ``build()`` for ``key`` with arguments like ``args`` (only their shapes,
        dtypes and placements are read, here, on the caller's thread) in a background thread: its first call
        (`get`), later, runs the same jitted object, whose lowering and executable JAX then has in memory (the
        call waits for the thread if it has not finished). Used to compile the decode program while the prompt's
        prefill compiles (XLA releases the GIL while it compiles; a cold Flash-Next start built its prefill chunk in
        70 s and its decode program in 59 s one after the other, 2026-12-07). With a persistent compilation cache,
        the thread writes the program there as any compile does.

        The thread is not a daemon: a daemon thread inside XLA at interpreter exit aborts the process. A command
        that ends while one runs (an error, Ctrl-C, a sequence that stopped before its first decode call) leaves
        with ``os._exit`` instead of waiting for it (`strata_jax.cli.flags.run_command`, `compiles_ahead_running`).
        Returns whether a thread was started: not when ``key`` is built or started already. A failure in the thread
        is logged and left to the first call, which then compiles as it would have (and raises what is wrong)."""
        import jax

        if key in self:
            return False

        def shape_of(a):
            if not isinstance(a, jax.Array):
                return a   # numpy, None, Python scalars: as the call passes them
            # committed arrays keep their placement (the call's program depends on it), uncommitted ones have none
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if a.committed else None,
                                        weak_type=a.weak_type)

        spec = jax.tree.map(shape_of, args)
        jitted = build()

        def compile_ahead():
            t0 = time.perf_counter()
            try:
                jitted.lower(*spec).compile()
                log.info("compiled %s ahead in %.2f s", key, time.perf_counter() - t0)
            except Exception as e:
                log.warning("compiling %s ahead failed (its first call compiles it): %s: %s", key,
                            type(e).__name__, e)

        t = threading.Thread(target=compile_ahead, name=f"{AHEAD_THREAD}-{key}")
        self._ahead[key] = (t, jitted)
        self.ahead_started += 1
        t.start()
        return True

    def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        """The function for ``key``, built with ``build()`` (a jitted function) on first use, or the one an `ahead`
        compile started with. The first call of a new function is timed and logged as its compile (for an `ahead`
        one: the wait for that compile, if it has not finished)."""
        fn = self._fns.get(key)
        if fn is not None:
            self._fns.move_to_end(key)
            return fn
        pending = self._ahead.pop(key, None)
        ahead, jitted = pending if pending is not None else (None, build())
        self.ahead_used += pending is not None
        cache = self
        generation = self._generation

        def first_call(*args, **kwargs):
            t0 = time.perf_counter()
            notify, timer, fired = cache.notify, None, []
            if notify is not None:
                def announce():
                    fired.append(True)
                    notify(key, None)

                timer = threading.Timer(cache.notice_after, announce)
                timer.daemon = True
                timer.start()
            try:
                if ahead is not None:
                    ahead.join()   # the program of this jitted object is compiled now (in memory)
                out = jitted(*args, **kwargs)
                import jax

                jax.block_until_ready(out)
            finally:
                if timer is not None:
                    timer.cancel()
                    timer.join()
            dt = time.perf_counter() - t0
            if fired:
                notify(key, dt)
            cache.compile_seconds += dt
            log.info("compiled %s in %.2f s", key, dt)
            if cache._generation == generation:
                cache._fns[key] = jitted
            return out

        self.compiles += 1
        self._fns[key] = first_call
        while len(self._fns) > self.capacity:
            self._fns.popitem(last=False)
            self.evictions += 1
        return first_call

    def clear(self) -> None:
        """Drop every function (the next `get` of a key builds and traces it again: e.g. after an environment
        variable read at trace time changed). A function fetched before and first called after is not stored; an
        `ahead` compile still running is forgotten (its program may not be the one the next build traces)."""
        self._fns.clear()
        self._ahead.clear()
        self._generation += 1

    def __len__(self) -> int:
        return len(self._fns)

    def __contains__(self, key) -> bool:
        """``key`` is built (or its first call is fetched), or an `ahead` compile of it was started."""
        return key in self._fns or key in self._ahead


AHEAD_THREAD = "strata-compile-ahead"   # the name prefix of `CompileCache.ahead`'s threads


def compiles_ahead_running() -> bool:
    """Whether an `CompileCache.ahead` compile is still running (a process that ends now would wait for it)."""
    return any(t.name.startswith(AHEAD_THREAD) and t.is_alive() for t in threading.enumerate())


def describe_key(key, n_stages: int = 1) -> str:
    """What a `CompileCache` key compiles, in words, for the keys `strata_jax.pipeline.engine.Engine` and
    `strata_jax.pipeline.mtp_chain` build:

    * ``(stage, "prefill" | "step" | "window", B, T, "last" | "all", n_slots)``: ``prefill chunk (128 rows)``
      (``, all logits`` for ``all``), ``decode step (1 of 4 slots)``, ``verify window (1 x 4 rows, 2 slots)``;
    * ``(stage, "commit", leaf shapes, n_slots)``: ``window commit (2 slots)``;
    * ``(stage, "reset", n_slots)``: ``slot reset (2 slots)``;
    * ``(0, "steps", B, n, n_slots)``: ``4 decode steps in one program (1 of 2 slots)``;
    * ``("mtp", "prefill" | "window", B, T, n_draft, n_slots)``: ``MTP draft chain (3 drafts, 1 x 4 rows)``;

    with ``, stage 2 of 3`` on a split. Any other key: its ``str``."""
    def slots(n, used=None):
        if used is None or used == n:
            return f"{n} slot{'s' if n != 1 else ''}"
        return f"{used} of {n} slots"

    if isinstance(key, tuple) and len(key) == 6 and key[0] == "mtp":
        _, mode, B, T, n, n_slots = key
        return (f"MTP draft chain ({n} draft{'s' if n != 1 else ''}, {B} x {T} rows"
                f"{', prompt' if mode == 'prefill' else ''})")
    if not (isinstance(key, tuple) and len(key) >= 3 and isinstance(key[0], int) and isinstance(key[1], str)):
        return str(key)
    stage, kind = key[0], key[1]
    if kind in ("prefill", "step", "window") and len(key) == 6:
        _, _, B, T, logits, n_slots = key
        if kind == "prefill":
            what = f"prefill chunk ({T} rows{'' if B == 1 else f' x {B}'}{', all logits' if logits == 'all' else ''})"
        elif kind == "step":
            what = f"decode step ({slots(n_slots, B)})"
        else:
            what = f"verify window ({B} x {T} rows{'' if n_slots == 1 else f', {slots(n_slots)}'})"
    elif kind == "commit" and len(key) == 4:
        what = f"window commit ({slots(key[3])})"
    elif kind == "reset" and len(key) == 3:
        what = f"slot reset ({slots(key[2])})"
    elif kind == "steps" and len(key) == 5:
        what = f"{key[3]} decode steps in one program ({slots(key[4], key[2])})"
    else:
        return str(key)
    return what + (f", stage {stage + 1} of {n_stages}" if n_stages > 1 else "")


class XlaCacheStats:
    """Reads and writes of JAX's persistent compilation cache in this process, from `jax.monitoring` events
    (``/jax/compilation_cache/compile_requests_use_cache``, ``.../cache_hits``, ``.../cache_misses``; the last fires
    when a compiled program is written). The same events on jax 0.10 and 0.11.

    Attributes:
      path: the cache folder; requests: compiles that consulted it; hits: programs read from it; written: programs
      compiled and stored (the others, below the size / time thresholds, were compiled and not kept); hit_at,
      written_at: `time.perf_counter` of the latest read and write (-inf before the first).
    """

    def __init__(self, path: str):
        self.path = path
        self.requests = self.hits = self.written = 0
        self.hit_at = self.written_at = float("-inf")
        self._lock = threading.Lock()   # the events also fire in the threads that compile ahead

    def _on_event(self, event: str, **kwargs) -> None:
        with self._lock:
            if event == "/jax/compilation_cache/compile_requests_use_cache":
                self.requests += 1
            elif event == "/jax/compilation_cache/cache_hits":
                self.hits += 1
                self.hit_at = time.perf_counter()
            elif event == "/jax/compilation_cache/cache_misses":
                self.written += 1
                self.written_at = time.perf_counter()

    def only_read_since(self, t0: float) -> bool:
        """Programs were read since ``t0`` (a `time.perf_counter` value) and none was compiled and written."""
        return self.hit_at >= t0 and self.written_at < t0

    def summary(self) -> str:
        """``XLA cache: 3 read, 1 compiled and written`` (programs; a window function may hold several)."""
        return f"XLA cache: {self.hits} read, {self.written} compiled and written"


_XLA_STATS: XlaCacheStats | None = None


def use_persistent_cache(path: str, min_compile_seconds: float = 0.0) -> XlaCacheStats:
    """Turn on JAX's persistent compilation cache in folder ``path`` (created) and count its use.

    Call it before anything compiles: JAX decides once per process, at the first compile, whether the cache is used.
    Programs whose XLA compile takes at least ``min_compile_seconds`` are stored, whatever their size. The default
    0 stores every program: JAX's default of 1 s keeps nothing on a fast machine, where the windows' XLA compile
    alone is shorter, and any threshold makes what is stored depend on the machine's load (a program that took
    0.09 s in the first run and 0.11 s in the second is compiled twice and stored by the second). Returns the process's `XlaCacheStats` (one listener per process; a second call moves the folder).
    """
    global _XLA_STATS
    import os

    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size threshold, no override
    if _XLA_STATS is None:
        _XLA_STATS = XlaCacheStats(path)
        jax.monitoring.register_event_listener(_XLA_STATS._on_event)
    _XLA_STATS.path = path
    return _XLA_STATS
