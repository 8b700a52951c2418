"""qwen35moe: Qwen3.5 / Qwen3.6 MoE GGUFs (Qwen3.6-35B-A3B: 40 layers, 256 experts top 8 + a shared expert), run by
the hybrid stage of `strata_jax.models.hybrid`; the ``nextn`` MTP block when the file has one.

Conventions (HF ``modeling_qwen3_5_moe.py``; llama.cpp's converter ``Qwen3_5MoeTextModel`` and
``src/models/qwen35moe.cpp``) and the traps met with them (the full list: experiments/parity/README_hybrid.md):
- every ``full_attention_interval``-th layer is gated attention, the others Gated DeltaNet;
- the converter reorders the GDN value heads to *tiled* order (v-head j uses k-head ``j % Hk``), HF keeps them
  grouped: ``v_order="tiled"``;
- the GDN output gate is SiLU (no key says so); MoE top-k weights always renormalised (no key either);
- MRoPE sections (``rope.dimension_sections``) reduce to plain partial RoPE for text (equal position ids).
"""

from __future__ import annotations

from strata_jax.layers.mtp import NextNMTP
from strata_jax.models.family import Family
from strata_jax.models.hybrid import HybridConfig, HybridStage, hybrid_fields


def read_config(g) -> HybridConfig:
    """The `HybridConfig` of an open qwen35moe GGUF (``qwen35moe.*`` keys).

    Raises:
      StrataError: a required key (``block_count``, ``ssm.*``, ``expert_count``, ``expert_used_count``, ...) is
        missing.
    """
    return HybridConfig(**hybrid_fields(g, moe=True), v_order="tiled", gdn_gate="silu")


FAMILY = Family("qwen35moe", read_config, HybridStage, mtp=NextNMTP, recurrent=True,
                description="Qwen3.5 / Qwen3.6 MoE hybrids (Gated DeltaNet + gated attention, MoE)")
