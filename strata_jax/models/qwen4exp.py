"""qwen4exp: Qwen3.8-Flash-Next GGUFs (48 layers, 4 hyper-connection streams, QSA sparse attention, a per-layer
n-gram embedding, 512 experts top 10 + a shared expert), run by the hybrid stage of `strata_jax.models.hybrid` with
its hyper-connection block; its MTP layer under this engine's tensor names (`strata_jax.layers.mtp.HCMTP`).

Conventions (HF ``modeling_qwen4_exp.py``; llama.cpp's converter ``conversion/qwen4exp.py`` and
``src/models/qwen4exp.cpp``) and the traps met with them (the full list:
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

from strata_jax.config import MAX_HEADS, MAX_TOKEN_ID, MAX_WIDTH
from strata_jax.errors import UnsupportedError
from strata_jax.gguf.metadata import get_array, get_int, key_error
from strata_jax.layers.mtp import HCMTP
from strata_jax.layers.ple import TABLE as PLE_TABLE
from strata_jax.models.family import Family
from strata_jax.models.hybrid import HybridConfig, HybridStage, hybrid_fields


def read_config(g) -> HybridConfig:
    """The `HybridConfig` of an open qwen4exp GGUF (``qwen4exp.*`` keys).

    Raises:
      StrataError: a required key (``hyper_connection.count``, ``attention.indexer.*``, ``ple.*`` of a file with a
        PLE layer, the shared hybrid keys) is missing, or a key has the wrong type or is out of range
        (`strata_jax.gguf.metadata`; the PLE arrays: ``ple.ngram_size`` multipliers, ``(ngram_size - 1) *
        heads_per_ngram`` head sizes and offsets inside the table); UnsupportedError: more than one PLE layer.
    """
    path = g.path
    p = g.architecture + "."
    kw = hybrid_fields(g, moe=True)
    n_layer = kw["n_layer"]
    ratios = get_array(g, p + "attention.compress_ratios", None, of="int", min_length=n_layer, min=0,
                       max=MAX_WIDTH)
    ratios = ratios[:n_layer] if ratios is not None else (0,) * n_layer
    kw.update(
        v_order="tiled",
        gdn_gate="sigmoid",
        hc=get_int(g, p + "hyper_connection.count", min=1, max=MAX_HEADS),
        hc_lowrank=get_int(g, p + "hyper_connection.low_rank", 0, min=0, max=MAX_WIDTH),
        idx_heads=get_int(g, p + "attention.indexer.head_count", min=1, max=MAX_HEADS),
        idx_head_dim=get_int(g, p + "attention.indexer.key_length", min=1, max=MAX_WIDTH),
        idx_budget=get_int(g, p + "attention.indexer.top_k", min=1, max=1 << 40),
        idx_ratio=ratios,
        ple_layers=get_array(g, p + "ple.layers", (), of="int", min=0, max=n_layer - 1),
    )
    if kw["ple_layers"]:
        if len(kw["ple_layers"]) > 1:
            raise UnsupportedError(f"{path}: {len(kw['ple_layers'])} PLE layers (one table and one hash "
                                   "parameter set per file are read)")
        ngram = get_int(g, p + "ple.ngram_size", min=2, max=64)
        hpn = get_int(g, p + "ple.heads_per_ngram", min=1, max=MAX_HEADS)
        n_ple_heads = (ngram - 1) * hpn  # bigram .. ngram heads (strata_jax.layers.ple)
        kw.update(
            ple_ngram=ngram,
            ple_heads_per_ngram=hpn,
            ple_conv=get_int(g, p + "ple.conv_kernel", 4, min=1, max=1 << 10),
            ple_eos=get_int(g, p + "ple.eos_token_id", kw["eos_id"], min=-1, max=MAX_TOKEN_ID),
            ple_mult=get_array(g, p + "ple.layer_multipliers", of="int", length=ngram, min=1, max=(1 << 63) - 1),
            ple_sizes=get_array(g, p + "ple.head_vocab_sizes", of="int", length=n_ple_heads, min=1, max=1 << 40),
            ple_offsets=get_array(g, p + "ple.head_offsets", of="int", length=n_ple_heads, min=0, max=1 << 40),
        )
        ends = [o + s for o, s in zip(kw["ple_offsets"], kw["ple_sizes"])]
        if g.has(PLE_TABLE) and max(ends) > g.info(PLE_TABLE).shape[0]:
            raise key_error(g, p + "ple.head_offsets", f"inside the {g.info(PLE_TABLE).shape[0]} rows of "
                            f"{PLE_TABLE} (each plus its ple.head_vocab_sizes entry)", kw["ple_offsets"])
    return HybridConfig(**kw)


FAMILY = Family("qwen4exp", read_config, HybridStage, mtp=HCMTP, recurrent=True,
                description="Qwen3.8-Flash-Next (hyper-connections, QSA, PLE, MoE)")
