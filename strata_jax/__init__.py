"""strata_jax: a JAX/XLA inference engine for GGUF language models (dense llama / qwen2 / gemma3 / qwen3, qwen3moe,
and the hybrid Gated-DeltaNet families qwen4exp, qwen35moe, qwen3next, qwen35), with exact speculative verify
windows, a layer split across devices and batch slots."""

__version__ = "0.1.0"
