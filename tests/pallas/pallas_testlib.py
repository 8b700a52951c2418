"""Helpers shared by the Pallas op tests."""

import jax
import numpy as np

# Every test runs each op through the reference and the kernel in interpret mode; on a GPU also the compiled kernel.
IMPLS = ["reference", "interpret"] + (["kernel"] if jax.default_backend() in ("gpu", "cuda", "rocm") else [])


def assert_bits_equal(a, b, what=""):
    a = np.asarray(a)
    b = np.asarray(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
        diff = np.argwhere(a != b)
        raise AssertionError(f"{what}: not bit-identical at {len(diff)} elements, first {diff[:3].tolist()}; "
                             f"max |diff| {np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)))}")


def assert_close_rel(got, want64, rtol, what="", scale=None):
    """max |got - want| <= rtol * scale, with scale = max |want| unless given (norm-wise relative error)."""
    got = np.asarray(got, np.float64)
    want64 = np.asarray(want64, np.float64)
    assert got.shape == want64.shape, (what, got.shape, want64.shape)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (unwritten / poisoned element?)"
    s = np.max(np.abs(want64)) if scale is None else scale
    err = np.abs(got - want64)
    assert np.all(err <= rtol * s), f"{what}: max rel error {np.max(err / s):.3g} > {rtol}"


def random_weight(rng, qtype, n_out, k_in, lead=()):
    """Fresh random GGUF weight [*lead, n_out, ...] with finite random scales (`strata_jax.testing.blocks`)."""
    from strata_jax.testing.blocks import random_blocks
    return random_blocks(rng, qtype, n_out, k_in, lead)
