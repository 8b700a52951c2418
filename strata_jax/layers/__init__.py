"""Layers shared by every family: norms, RoPE, quantized linear maps, attention with a KV cache, MLPs; the hybrid
layers (gated delta net, QSA, MoE, hyper-connections, PLE) sit beside them. A family file in `strata_jax.models`
only wires these together."""
