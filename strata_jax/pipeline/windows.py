"""One jitted function per (stage, kind, row layout), kept in a bounded LRU compile cache.

The key is static: the stage index, the kind of call (``window``, ``step`` = window + commit of every valid row,
``prefill``, ``commit``) and the row layout ``(B, T)``. Each compile is logged with its duration; the count is in the
stats. When the cache is full the least recently used function is dropped (XLA frees its executable).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Hashable

log = logging.getLogger("strata_jax")


class CompileCache:
    """A bounded LRU of compiled functions.

    Args:
      capacity: most functions kept (>= 1).

    Attributes:
      compiles: functions built so far (including rebuilt evictions).
      compile_seconds: total seconds spent in first calls (trace + compile + first run).
    """

    def __init__(self, capacity: int = 32):
        if capacity < 1:
            raise ValueError("compile cache capacity must be >= 1")
        self.capacity = capacity
        self._fns: collections.OrderedDict[Hashable, Callable] = collections.OrderedDict()
        self.compiles = 0
        self.compile_seconds = 0.0
        self.evictions = 0

    def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        """The function for ``key``, built with ``build()`` (a jitted function) on first use. The first call of a new
        function is timed and logged as its compile."""
        fn = self._fns.get(key)
        if fn is not None:
            self._fns.move_to_end(key)
            return fn
        jitted = build()
        cache = self

        def first_call(*args, **kwargs):
            t0 = time.perf_counter()
            out = jitted(*args, **kwargs)
            import jax

            jax.block_until_ready(out)
            dt = time.perf_counter() - t0
            cache.compile_seconds += dt
            log.info("compiled %s in %.2f s", key, dt)
            cache._fns[key] = jitted
            return out

        self.compiles += 1
        self._fns[key] = first_call
        while len(self._fns) > self.capacity:
            self._fns.popitem(last=False)
            self.evictions += 1
        return first_call

    def __len__(self) -> int:
        return len(self._fns)
