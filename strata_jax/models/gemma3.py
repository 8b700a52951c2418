"""gemma3: Gemma 3 text GGUFs (gemma3-270m), run by the attention-only stage of `strata_jax.models.dense`.

Facts the files do not state, from HF ``Gemma3TextConfig`` and llama.cpp ``LLM_ARCH_GEMMA3``:
- every 6th layer is global (``(i + 1) % 6 == 0``, ``sliding_window_pattern = 6``), the others slide over
  ``attention.sliding_window`` cells (512); local layers use RoPE base 10000 (``rope_local_base_freq``);
- token embeddings are scaled by sqrt(hidden); the GGUF norm weights already include Gemma's +1;
- extra norms after attention and after the MLP; per-head q/k norms; GeGLU with tanh-GELU;
- softmax scale ``attention.scale`` when present, else 1/sqrt(head_dim) (HF ``query_pre_attn_scalar`` = 256 =
  head_dim for the 270M model).
"""

from __future__ import annotations

import math

from strata_jax.config import ModelConfig
from strata_jax.gguf.metadata import get_float, get_int
from strata_jax.models.dense import DenseStage, dense_fields
from strata_jax.models.family import Family


def read_config(g) -> ModelConfig:
    """The `ModelConfig` of an open gemma3 GGUF (``gemma3.*`` keys, module docstring).

    Raises:
      StrataError: ``gemma3.block_count``, ``feed_forward_length``, ``embedding_length`` or ``attention.head_count``
        is missing.
    """
    p = g.architecture + "."
    kw = dense_fields(g)
    n_layer, n_embd, head_dim = kw["n_layer"], kw["n_embd"], kw["head_dim"]
    kw.update(
        rope_neox=True,
        sliding_window=get_int(g, p + "attention.sliding_window", 512, min=1, max=1 << 40),
        # HF Gemma3TextConfig: sliding_window_pattern 6 -> layer i is global iff (i + 1) % 6 == 0.
        layer_local=tuple((i + 1) % 6 != 0 for i in range(n_layer)),
        rope_theta_local=10000.0,  # HF Gemma3TextConfig.rope_local_base_freq
        qk_norm=True,
        post_norms=True,
        mlp_act="gelu_tanh",
        embed_scale=math.sqrt(n_embd),
        attn_scale=get_float(g, p + "attention.scale", 1.0 / math.sqrt(head_dim), positive=True),
    )
    return ModelConfig(**kw)


FAMILY = Family("gemma3", read_config, DenseStage, description="Gemma 3 text models (sliding window)")
