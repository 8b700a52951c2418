"""Shared fixtures: real model files (fetched once into the cache by the registry, as a user would get them) and a
session-wide engine per model so that compiled functions are reused across tests.

Most of the suite's time is XLA compiling, and compiled functions belong to one `Engine` (each engine has its own
compile cache). Tests therefore share engines: ``engine_for`` keys them by what the engine is (model, context, slots,
layer split and the devices its stages actually use), so ``devices=None`` and ``devices=jax.devices()[:1]`` give the
same one-stage engine. Use ``CTX`` as the context unless a test needs another one: every file then shares the same
engines (and the same compiled windows). ``plain_decode`` shares the plain (solo, T = 1) reference decodes that
several files compare against (e.g. the dense HF fixtures' prompts: test_dense_parity, test_spec, test_windows).

XLA:CPU maps each compiled kernel's code and data into memory separately (about three mappings per fusion), so
every live executable holds thousands of mappings, and a process that keeps all of the suite's engines alive passes
Linux's limit of 65,530 (``vm.max_map_count``) late in the run: the next compile's mmap fails and XLA crashes with a
segfault or an abort. ``_release_when_maps_run_low`` drops the shared engines and JAX's caches before a test file
when the process holds more than ``MAP_BUDGET`` mappings (later files rebuild what they use).

Every program the run compiles is also kept in JAX's persistent compilation cache, in one folder for the whole run
(both pytest-xdist workers, removed at the end; ``STRATA_TEST_XLA_CACHE`` names it, ``off`` turns it off): a program
compiled again -- the same engine built in the other worker, a file's own engine of a model the shared ones hold
too, an engine rebuilt after ``_release_when_maps_run_low`` -- is read back instead of compiled. The programs and
what they compute are the same; only XLA's compile is skipped. Command-line tests run in subprocesses keep their
own ``--xla_cache_dir``.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import pytest

from strata_jax.models_registry import fetch_model

CTX = 96  # the context of the shared engines (tests/test_windows, test_spec, test_split, test_slots, ...)

_ENGINES = {}
_PLAIN = {}

MAP_BUDGET = 30_000  # of the 65,530 mappings Linux allows a process by default: room for the largest test file


def pytest_configure(config):
    """One persistent compilation cache for the run, set before anything compiles (JAX decides at the first compile
    whether the process uses it). The first process (the xdist controller, or the only one) makes the folder and
    passes it to the workers through the environment; it removes the folder at the end."""
    path = os.environ.get("STRATA_TEST_XLA_CACHE")
    if path == "off":  # STRATA_TEST_XLA_CACHE=off: compile everything in every process
        return
    if not path:
        path = os.environ["STRATA_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="strata_jax_tests_xla_")
        config._strata_xla_cache_owned = path
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program (not only slow compiles)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config):
    path = getattr(config, "_strata_xla_cache_owned", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop("STRATA_TEST_XLA_CACHE", None)


def _n_maps() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to watch
        return None


@pytest.fixture(scope="module", autouse=True)
def _release_when_maps_run_low():
    """Before each test file: when the process holds more than ``MAP_BUDGET`` memory mappings, drop the shared
    engines, the shared plain decodes and JAX's compiled functions, which frees their executables' mappings."""
    n = _n_maps()
    if n is not None and n > MAP_BUDGET:
        import jax

        _ENGINES.clear()
        _PLAIN.clear()
        jax.clear_caches()
        gc.collect()
    yield


@pytest.fixture(scope="session")
def model_path():
    def get(name: str):
        return str(fetch_model(name, quiet=True))

    return get


def _stage_devices(layer_split, devices):
    """The devices the engine's stages run on: the first (number of stages) of ``devices`` (default: all)."""
    import jax

    devs = list(devices) if devices is not None else jax.devices()
    n_stages = 1 + (len([s for s in str(layer_split).split(",") if s.strip()]) if layer_split else 0)
    return tuple(str(d) for d in devs[:n_stages])


@pytest.fixture(scope="session")
def engine_for(model_path):
    """engine_for(name, max_context=CTX, n_slots=...) -> a cached Engine (one per distinct engine)."""
    from strata_jax.pipeline.engine import Engine

    def get(name: str, max_context: int = CTX, n_slots: int = 1, layer_split=None, devices=None):
        key = (name, max_context, n_slots, layer_split or None, _stage_devices(layer_split, devices))
        if key not in _ENGINES:
            path = name if name.endswith(".gguf") else model_path(name)
            _ENGINES[key] = Engine(path, max_context=max_context, n_slots=n_slots, layer_split=layer_split,
                                   devices=devices)
        return _ENGINES[key]

    return get


@pytest.fixture(scope="session")
def plain_decode():
    """plain_decode(engine, prompt_ids, n, sampling=greedy) -> a `Generation` of at least ``n`` tokens: the plain
    decode (no EOS, logits dumped) of ``prompt_ids`` on ``engine``'s slot 0, computed once per (engine, prompt,
    sampling). Decoding is causal, so its first ``n`` tokens and logits are those of an ``n``-token decode: slice."""
    from strata_jax.pipeline.solo import generate
    from strata_jax.sampling import SamplingParams

    def get(engine, prompt_ids, n: int, sampling=SamplingParams(0.0)):
        key = (id(engine), tuple(int(t) for t in prompt_ids), sampling)
        g = _PLAIN.get(key)
        if g is None or len(g.tokens) < n:
            g = _PLAIN[key] = generate(engine, list(prompt_ids), max_new_tokens=n, sampling=sampling, eos_ids=(),
                                       dump_logits=True)
        return g

    return get
