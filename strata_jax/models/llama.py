"""llama: Llama-architecture GGUFs (SmolLM2-135M, Llama 2/3, ...), run by the attention-only stage of
`strata_jax.models.dense`.

Traps, from llama.cpp's converter (``LlamaModel.permute``) and ``src/models/llama.cpp``:
- the converter permutes the rows of ``attn_q`` / ``attn_k`` so that RoPE rotates *adjacent* pairs (ggml's
  "normal" RoPE), not HF's half-split pairs: ``rope_neox=False``;
- no ``output.weight`` means the head is tied to ``token_embd`` (SmolLM2).
"""

from __future__ import annotations

from strata_jax.config import ModelConfig
from strata_jax.models.dense import DenseStage, dense_fields
from strata_jax.models.family import Family


def read_config(g) -> ModelConfig:
    """The `ModelConfig` of an open llama GGUF (``llama.*`` keys).

    Raises:
      StrataError: ``llama.block_count``, ``feed_forward_length``, ``embedding_length`` or ``attention.head_count``
        is missing.
    """
    kw = dense_fields(g)
    kw.update(rope_neox=False)  # the converter's Q/K row permutation: adjacent-pair RoPE
    return ModelConfig(**kw)


FAMILY = Family("llama", read_config, DenseStage, description="Llama-architecture dense models (SmolLM2, Llama)")
