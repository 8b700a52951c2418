"""qwen3next: Qwen3-Next GGUFs (Qwen3-Next-80B-A3B: 48 layers, 512 experts top 10 + a shared expert), run by the
hybrid stage of `strata_jax.models.hybrid`; the ``nextn`` MTP block when the file has one.

Conventions (HF ``modeling_qwen3_next.py``; llama.cpp's converter ``Qwen3NextModel`` and ``src/models/qwen3next.cpp``)
and the traps met with them (the full list: experiments/parity/README_hybrid.md):
- unlike qwen35*, the GGUF keeps HF's *grouped* GDN value-head order (v-head j uses k-head ``j // (Hv/Hk)``):
  ``v_order="grouped"``;
- beta and alpha come fused as ``ssm_ba`` (per k-head group ``[b (r) | a (r)]``; `strata_jax.layers.gdn`);
- ``feed_forward_length`` is HF's ``intermediate_size`` (unused: every layer is MoE);
- checkpoints without ``mtp.*`` tensors need the converter's ``--no-mtp``.
"""

from __future__ import annotations

from strata_jax.layers.mtp import NextNMTP
from strata_jax.models.family import Family
from strata_jax.models.hybrid import HybridConfig, HybridStage, hybrid_fields


def read_config(g) -> HybridConfig:
    """The `HybridConfig` of an open qwen3next GGUF (``qwen3next.*`` keys).

    Raises:
      StrataError: a required key (``block_count``, ``ssm.*``, ``expert_count``, ``expert_used_count``, ...) is
        missing.
    """
    return HybridConfig(**hybrid_fields(g, moe=True), v_order="grouped", gdn_gate="silu")


FAMILY = Family("qwen3next", read_config, HybridStage, mtp=NextNMTP, recurrent=True,
                description="Qwen3-Next hybrids (Gated DeltaNet + gated attention, MoE)")
