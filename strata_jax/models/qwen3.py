"""qwen3: Qwen3 dense GGUFs (Qwen3-0.6B ... 32B), run by the attention-only stage of `strata_jax.models.dense`.

Conventions (HF ``modeling_qwen3.py``; llama.cpp's converter ``Qwen3Model(Qwen2Model)`` and ``src/models/qwen3.cpp``)
and the traps met with them:
- per-head RMSNorm on q and k (``blk.N.attn_{q,k}_norm`` [head_dim]), applied after the projection and *before*
  RoPE; a plain weight (HF initialises it to ones; no +1 convention, the converter stores it as is);
- ``attention.key_length`` (head_dim, 128 on the real models) is not ``embedding_length / head_count``: the Q
  projection is [n_head * head_dim, D] and ``attn_output`` [D, n_head * head_dim] (the 0.6B: 16 x 128 = 2048 wide on
  a 1024 hidden);
- half-split (NeoX) RoPE over the whole head (the converter does not permute rows; llama.cpp asserts
  ``n_rot == head_dim``); no Q/K/V biases (unlike qwen2);
- the small models tie the head to the embedding (no ``output.weight``);
- RoPE scaling (YaRN, suggested for > 32K) is refused (`strata_jax.config.refuse_rope_scaling`).
"""

from __future__ import annotations

from strata_jax.config import ModelConfig, refuse_rope_scaling
from strata_jax.models.dense import DenseStage, dense_fields
from strata_jax.models.family import Family


def read_config(g) -> ModelConfig:
    """The `ModelConfig` of an open qwen3 GGUF (``qwen3.*`` keys, module docstring).

    Raises:
      StrataError: ``qwen3.block_count``, ``feed_forward_length``, ``embedding_length`` or ``attention.head_count``
        is missing; UnsupportedError: RoPE scaling.
    """
    refuse_rope_scaling(g)
    kw = dense_fields(g)
    kw.update(rope_neox=True, qk_norm=True)
    return ModelConfig(**kw)


FAMILY = Family("qwen3", read_config, DenseStage, description="Qwen3 dense models (q/k norms)")
