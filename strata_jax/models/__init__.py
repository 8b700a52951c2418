"""Model families: one file per GGUF architecture (``llama.py``, ``qwen35moe.py``, ...), each defining its
`strata_jax.models.family.Family` (GGUF key reading, stage module, MTP draft layer), looked up by
``general.architecture`` in `strata_jax.models.registry`. Code the families share: `strata_jax.models.dense` (the
attention-only stage), `strata_jax.models.hybrid` (the Gated DeltaNet hybrid stage) and `strata_jax.layers`."""

from strata_jax.models.registry import (build_stage, config_from_gguf, family_of, get_family, mtp_head,
                                        supported_archs)

__all__ = ["build_stage", "config_from_gguf", "family_of", "get_family", "mtp_head", "supported_archs"]
