"""qwen35: Qwen3.5 dense hybrid GGUFs (Qwen3.5-0.8B ... 27B: Gated DeltaNet + gated attention, a SwiGLU FFN in every
layer), run by the hybrid stage of `strata_jax.models.hybrid`; the ``nextn`` MTP block when the file has one (its
FFN is dense too). Same tokenizer as the qwen35moe models, so a small qwen35 can draft for them.

Conventions (HF ``modeling_qwen3_5.py``; llama.cpp's converter ``Qwen3_5TextModel`` and ``src/models/qwen35.cpp``)
and the traps met with them:
- the GDN, the gated attention, the norms (zero-centred in HF, +1 folded in by the converter, except the GDN's
  ``ssm_norm``) and the value-head *tiling* are those of qwen35moe (`strata_jax.models.qwen35moe`);
- the FFN is ``blk.N.ffn_{gate,up,down}`` of width ``feed_forward_length`` (no ``expert_*`` keys); its norm is
  ``post_attention_norm``;
- the MTP block (``blk.{n_layer}.nextn.*`` + a full-attention block with a dense FFN) is appended after the trunk:
  ``block_count`` counts it and ``nextn_predict_layers`` says how many; ``attention.recurrent_layers`` has an entry
  (False) for it;
- HF's ``Qwen3_5TextConfig`` does not save ``full_attention_interval`` (it expands it into ``layer_types``), while
  the converter writes ``full_attention_interval`` from config.json with a default of 4: the per-layer
  ``attention.recurrent_layers`` is the key to trust (llama.cpp and this reader do);
- llama.cpp takes the GDN value head width from ``ssm.state_size`` (= key width); this reader uses
  ``ssm.inner_size / ssm.time_step_rank`` (equal on every released model);
- RoPE scaling is refused (`strata_jax.config.refuse_rope_scaling`).
"""

from __future__ import annotations

from strata_jax.config import refuse_rope_scaling
from strata_jax.layers.mtp import NextNMTP
from strata_jax.models.family import Family
from strata_jax.models.hybrid import HybridConfig, HybridStage, hybrid_fields


def read_config(g) -> HybridConfig:
    """The `HybridConfig` of an open qwen35 GGUF (``qwen35.*`` keys, module docstring).

    Raises:
      StrataError: a required key (``block_count``, ``feed_forward_length``, ``ssm.*``, ...) is missing;
      UnsupportedError: RoPE scaling.
    """
    refuse_rope_scaling(g)
    return HybridConfig(**hybrid_fields(g, moe=False), v_order="tiled", gdn_gate="silu")


FAMILY = Family("qwen35", read_config, HybridStage, mtp=NextNMTP, recurrent=True,
                description="Qwen3.5 dense hybrids (Gated DeltaNet + gated attention, SwiGLU FFN)")
