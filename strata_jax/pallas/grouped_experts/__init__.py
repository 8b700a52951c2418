"""Routed MoE experts (SwiGLU over GGUF-quantized stacked weights): ``moe_experts``. See `api` for the contract."""

from strata_jax.pallas.grouped_experts.api import moe_experts

__all__ = ["moe_experts"]
