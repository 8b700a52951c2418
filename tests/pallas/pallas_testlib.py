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


# fp16 scale fields (byte offsets inside a block) of each block format, overwritten with finite values in tests
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# scale magnitudes that make the decoded weights O(0.1), as in real models
F16_SCALE = {"Q8_0": 1.5e-3, "Q4_0": 0.02, "Q4_1": 0.01, "Q5_0": 0.01, "Q5_1": 0.005, "Q2_K": 5e-3,
             "Q3_K": 1e-3, "Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 1e-4}


def random_weight(rng, qtype, n_out, k_in, lead=()):
    """Fresh random GGUF weight [*lead, n_out, ...]: random code bytes, finite random fp16 scales of either sign
    (magnitudes from F16_SCALE, so decoded weights are O(0.1))."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    qtype = Q(qtype)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        import ml_dtypes
        dt = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: ml_dtypes.bfloat16}[qtype]
        return (rng.standard_normal((*lead, n_out, k_in)) * 0.1).astype(dt)
    qb, bpb = GGML_QUANT_SIZES[qtype]
    nb = k_in // qb
    raw = rng.integers(0, 256, (*lead, n_out, nb, bpb), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype.name, ()):
        d = (rng.uniform(0.5, 1, raw.shape[:-1]) * F16_SCALE[qtype.name]
             * rng.choice([-1, 1], raw.shape[:-1])).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:-1], 2)
    return raw.reshape(*lead, n_out, nb * bpb)
