"""qwen3moe: Qwen3 MoE GGUFs (Qwen3-30B-A3B: 48 layers, 128 experts, top 8, no shared expert), run by the
attention-only stage of `strata_jax.models.dense` with the routed experts of `strata_jax.layers.moe` as every
layer's FFN.

Conventions (HF ``modeling_qwen3_moe.py``; llama.cpp's converter ``Qwen3MoeModel(Qwen2MoeModel)`` and
``src/models/qwen3moe.cpp``) and the traps met with them:
- attention as qwen3 (`strata_jax.models.qwen3`): per-head q/k RMSNorm before full NeoX RoPE, head_dim from
  ``attention.key_length``, no biases;
- the FFN norm is ``ffn_norm`` (the hybrids call theirs ``post_attention_norm``); the router ``ffn_gate_inp`` [E, D]
  and the stacked experts ``ffn_{gate,up,down}_exps``; there is no shared expert (no ``*_shexp`` tensors);
- router: softmax over all experts, top k, then the k weights are **renormalised to sum 1**. HF does that only with
  ``norm_topk_prob`` (default False in ``Qwen3MoeConfig``; True in the released checkpoints), but the GGUF keeps no
  such key and llama.cpp's graph hard-codes the renormalisation (``build_moe_ffn(..., norm_w=true, ...)``), so a
  file is run as llama.cpp runs it;
- every layer is an MoE layer: llama.cpp loads ``ffn_gate_inp`` for all of them (HF's ``mlp_only_layers`` /
  ``decoder_sparse_step`` variants cannot be expressed in a GGUF); a file without it fails to load with the
  missing tensor's name;
- ``expert_feed_forward_length`` is the expert width (``feed_forward_length`` is HF's unused dense width); without
  it llama.cpp takes ``feed_forward_length / expert_used_count``, and so does this reader;
- RoPE scaling (YaRN) is refused (`strata_jax.config.refuse_rope_scaling`).
"""

from __future__ import annotations

from strata_jax.config import MAX_EXPERTS, MAX_WIDTH, ModelConfig, refuse_rope_scaling
from strata_jax.gguf.metadata import get_int
from strata_jax.models.dense import DenseStage, dense_fields
from strata_jax.models.family import Family


def read_config(g) -> ModelConfig:
    """The `ModelConfig` of an open qwen3moe GGUF (``qwen3moe.*`` keys, module docstring).

    Raises:
      StrataError: ``qwen3moe.block_count``, ``expert_count``, ``expert_used_count``, ``embedding_length`` or
        ``attention.head_count`` is missing, a key has the wrong type or is out of range
        (`strata_jax.gguf.metadata`); UnsupportedError: RoPE scaling.
    """
    p = g.architecture + "."
    refuse_rope_scaling(g)
    kw = dense_fields(g, n_ff_key=None)
    n_expert = get_int(g, p + "expert_count", min=1, max=MAX_EXPERTS)
    n_used = get_int(g, p + "expert_used_count", min=1, max=n_expert)
    n_ff = get_int(g, p + "feed_forward_length", 0, min=0, max=MAX_WIDTH)
    kw.update(
        rope_neox=True,
        qk_norm=True,
        n_expert=n_expert,
        n_expert_used=n_used,
        expert_ff=get_int(g, p + "expert_feed_forward_length", n_ff // n_used, min=1, max=MAX_WIDTH),
    )
    return ModelConfig(**kw)


FAMILY = Family("qwen3moe", read_config, DenseStage,
                description="Qwen3 MoE models (routed experts, no shared expert)")
