"""Fresh random GGUF blocks with finite scales, for kernel tests and benchmarks (never zeros).

Source: the scale fields of ggml's block structs (``ggml/src/ggml-common.h``): the fp16 ``d`` (and ``dmin`` / ``m``)
at the byte offsets below; IQ1_M keeps its fp16 ``d`` in the top nibble of each of its four 16-bit scale words.
Code bytes are uniform random; scale fields get random finite fp16 values of either sign with magnitudes that make
the decoded weights O(0.1), as in real models.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

# fp16 scale fields (byte offsets inside a block) and their magnitude
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82),
              Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
              Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,), Q.IQ1_S: (0,)}
F16_SCALE = {Q.Q8_0: 1.5e-3, Q.Q4_0: 0.02, Q.Q4_1: 0.01, Q.Q5_0: 0.01, Q.Q5_1: 0.005, Q.Q2_K: 5e-3,
             Q.Q3_K: 1e-3, Q.Q4_K: 2e-4, Q.Q5_K: 1e-4, Q.Q6_K: 1e-4, Q.IQ4_NL: 1e-3, Q.IQ4_XS: 5e-5,
             Q.IQ2_XXS: 1e-3, Q.IQ2_XS: 1e-3, Q.IQ2_S: 1e-3, Q.IQ3_XXS: 2e-4, Q.IQ3_S: 2e-4, Q.IQ1_S: 1e-2,
             Q.IQ1_M: 1e-2}
_FLOATS = {Q.F32: np.float32, Q.F16: np.float16}


def random_blocks(rng: np.random.Generator, qtype, n_out: int, k_in: int, lead: tuple = ()) -> np.ndarray:
    """A random GGUF matrix [*lead, n_out, ...]: uint8 [..., row_bytes] for a block format, or float values
    [..., k_in] (float32 / float16 / ml_dtypes bfloat16) for F32 / F16 / BF16 (O(0.1), normal distribution)."""
    qtype = Q(qtype)
    if qtype in _FLOATS or qtype == Q.BF16:
        import ml_dtypes
        dt = _FLOATS.get(qtype, ml_dtypes.bfloat16)
        return (rng.standard_normal((*lead, n_out, k_in)) * 0.1).astype(dt)
    qb, bpb = GGML_QUANT_SIZES[qtype]
    nb = k_in // qb
    raw = rng.integers(0, 256, (*lead, n_out, nb, bpb), dtype=np.uint8)
    shape = raw.shape[:-1]

    def f16(scale):
        return (rng.uniform(0.5, 1, shape) * scale * rng.choice([-1, 1], shape)).astype(np.float16)

    for off in F16_FIELDS.get(qtype, ()):
        raw[..., off:off + 2] = f16(F16_SCALE[qtype]).view(np.uint8).reshape(*shape, 2)
    if qtype == Q.IQ1_M:  # d's 16 bits = the top nibbles of the scale words at bytes 48..55, low nibble first
        d = f16(F16_SCALE[qtype]).view(np.uint16)
        words = raw[..., 48:56].copy().view(np.uint16).reshape(*shape, 4)
        for i in range(4):
            words[..., i] = (words[..., i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        raw[..., 48:56] = words.view(np.uint8).reshape(*shape, 8)
    return raw.reshape(*lead, n_out, nb * bpb)
