"""Shared fixtures: real model files (fetched once into the cache by the registry, as a user would get them) and a
session-wide engine per model so that compiled functions are reused across tests."""

from __future__ import annotations

import pytest

from strata_jax.models_registry import fetch_model

_ENGINES = {}


@pytest.fixture(scope="session")
def model_path():
    def get(name: str):
        return str(fetch_model(name, quiet=True))

    return get


@pytest.fixture(scope="session")
def engine_for(model_path):
    """engine_for(name, max_context=..., n_slots=...) -> a cached Engine (one per argument set)."""
    from strata_jax.pipeline.engine import Engine

    def get(name: str, max_context: int = 256, n_slots: int = 1, layer_split=None, devices=None):
        key = (name, max_context, n_slots, layer_split, None if devices is None else tuple(str(d) for d in devices))
        if key not in _ENGINES:
            path = name if name.endswith(".gguf") else model_path(name)
            _ENGINES[key] = Engine(path, max_context=max_context, n_slots=n_slots, layer_split=layer_split,
                                   devices=devices)
        return _ENGINES[key]

    return get
