"""qwen2: Qwen2 / Qwen2.5 dense GGUFs (Qwen2.5-Coder 0.5B / 1.5B), run by the attention-only stage of
`strata_jax.models.dense`.

Conventions (HF ``modeling_qwen2.py``; llama.cpp ``src/models/qwen2.cpp``): half-split (NeoX) RoPE, Q/K/V
projections with biases (``blk.N.attn_{q,k,v}.bias``), a separate ``output.weight`` when the checkpoint has an untied
head (the 0.5B GGUF has one although HF ties it).
"""

from __future__ import annotations

from strata_jax.config import ModelConfig
from strata_jax.models.dense import DenseStage, dense_fields
from strata_jax.models.family import Family


def read_config(g) -> ModelConfig:
    """The `ModelConfig` of an open qwen2 GGUF (``qwen2.*`` keys).

    Raises:
      StrataError: ``qwen2.block_count``, ``feed_forward_length``, ``embedding_length`` or ``attention.head_count``
        is missing.
    """
    kw = dense_fields(g)
    kw.update(rope_neox=True)
    return ModelConfig(**kw)


FAMILY = Family("qwen2", read_config, DenseStage, description="Qwen2 / Qwen2.5 dense models")
