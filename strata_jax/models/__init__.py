"""Model families. Each family file only wires layers from `strata_jax.layers` into *stages*: the layers one device
runs in a layer split (the whole model when unsplit). `build_stage` picks the family from the config."""

from __future__ import annotations

from strata_jax.config import DENSE_ARCHS, ModelConfig
from strata_jax.errors import UnsupportedError


def hybrid_config_from_gguf(g) -> ModelConfig:
    """The config of a hybrid (qwen4exp / qwen35moe / qwen3next) GGUF file."""
    from strata_jax.models.hybrid import hybrid_config_from_gguf as impl

    return impl(g)


def build_stage(g, cfg: ModelConfig, start: int, stop: int, device=None):
    """The stage module for layers ``[start, stop)`` of ``cfg``'s family, weights placed on ``device``.

    Raises:
      UnsupportedError: an architecture with no stage implementation.
    """
    if cfg.arch in DENSE_ARCHS:
        from strata_jax.models.dense import DenseStage

        return DenseStage(g, cfg, start, stop, device)
    try:
        from strata_jax.models.hybrid import HybridStage
    except ImportError:
        raise UnsupportedError(f"architecture {cfg.arch!r} is not implemented yet") from None
    return HybridStage(g, cfg, start, stop, device)
