"""qwen4exp: Qwen3.8-Flash-Next GGUFs (48 layers, 4 hyper-connection streams, QSA sparse attention, a per-layer
n-gram embedding, 512 experts top 10 + a shared expert), run by the hybrid stage of `strata_jax.models.hybrid` with
its hyper-connection block; its MTP layer under this engine's tensor names (`strata_jax.layers.mtp.HCMTP`).

Conventions (HF ``modeling_qwen4_exp.py``; llama.cpp's converter ``conversion/qwen4exp.py`` and
``src/models/qwen4exp.cpp``; MODEL.md Part A) and the traps met with them (the full list:
experiments/parity/README_hybrid.md):
- the GDN output gate is **sigmoid** (HF ``output_gate_type``; no GGUF key: the arch implies it); value heads tiled;
- ``attention.indexer.top_k`` is the QSA budget in *cells* (blocks = top_k / compress ratio), and
  ``attention.compress_ratios`` per layer is 0 on GDN layers. The 0.3.36 converter writes all zeros when HF renamed
  ``full_attention`` to ``indexed_attention`` (then no layer is sparse);
- ``ple.layers`` is 0-based (HF ``ple_layer_ids`` is 1-based); the n-gram hash multipliers depend on the vocabulary
  size, so they are always read from the file (``ple.layer_multipliers``), never recomputed;
- one PLE layer is supported (one table, one hash parameter set per file).
"""

from __future__ import annotations

from strata_jax.config import require_key
from strata_jax.errors import UnsupportedError
from strata_jax.layers.mtp import HCMTP
from strata_jax.models.family import Family
from strata_jax.models.hybrid import HybridConfig, HybridStage, hybrid_fields


def read_config(g) -> HybridConfig:
    """The `HybridConfig` of an open qwen4exp GGUF (``qwen4exp.*`` keys, MODEL.md A§2.1).

    Raises:
      StrataError: a required key (``hyper_connection.count``, ``attention.indexer.*``, ``ple.*`` of a file with a
        PLE layer, the shared hybrid keys) is missing; UnsupportedError: more than one PLE layer.
    """
    md, path = g.metadata, g.path
    p = g.architecture + "."
    kw = hybrid_fields(g, moe=True)
    n_layer = kw["n_layer"]
    ratios = md.get(p + "attention.compress_ratios")
    ratios = tuple(int(r) for r in list(ratios)[:n_layer]) if ratios is not None else (0,) * n_layer
    kw.update(
        v_order="tiled",
        gdn_gate="sigmoid",
        hc=int(require_key(md, p + "hyper_connection.count", path)),
        hc_lowrank=int(md.get(p + "hyper_connection.low_rank", 0)),
        idx_heads=int(require_key(md, p + "attention.indexer.head_count", path)),
        idx_head_dim=int(require_key(md, p + "attention.indexer.key_length", path)),
        idx_budget=int(require_key(md, p + "attention.indexer.top_k", path)),
        idx_ratio=ratios,
        ple_layers=tuple(int(v) for v in list(md.get(p + "ple.layers", []))),
    )
    if kw["ple_layers"]:
        if len(kw["ple_layers"]) > 1:
            raise UnsupportedError(f"{path}: {len(kw['ple_layers'])} PLE layers (one table and one hash "
                                   "parameter set per file are read)")
        kw.update(
            ple_ngram=int(require_key(md, p + "ple.ngram_size", path)),
            ple_heads_per_ngram=int(require_key(md, p + "ple.heads_per_ngram", path)),
            ple_conv=int(md.get(p + "ple.conv_kernel", 4)),
            ple_eos=int(md.get(p + "ple.eos_token_id", md.get("tokenizer.ggml.eos_token_id", -1))),
            ple_mult=tuple(int(v) for v in list(require_key(md, p + "ple.layer_multipliers", path))),
            ple_sizes=tuple(int(v) for v in list(require_key(md, p + "ple.head_vocab_sizes", path))),
            ple_offsets=tuple(int(v) for v in list(require_key(md, p + "ple.head_offsets", path))),
        )
    return HybridConfig(**kw)


FAMILY = Family("qwen4exp", read_config, HybridStage, mtp=HCMTP, recurrent=True,
                description="Qwen3.8-Flash-Next (hyper-connections, QSA, PLE, MoE)")
