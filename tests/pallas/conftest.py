"""Shared fixtures for the Pallas op tests: a printed random seed, impl parametrisation, impls and helpers in pallas_testlib."""

import os
import random

import numpy as np
import pytest

@pytest.fixture
def rng(request):
    """A numpy Generator seeded from STRATA_TEST_SEED or a fresh random seed, printed so a failure can be replayed."""
    seed = int(os.environ.get("STRATA_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"\n[{request.node.name}] seed={seed} (replay with STRATA_TEST_SEED={seed})")
    return np.random.default_rng(seed)
