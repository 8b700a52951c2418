"""Typed model configurations, built from GGUF metadata.

One `ModelConfig` describes every family the engine runs. `config_from_gguf` reads the ``{arch}.*`` keys written
by llama.cpp's converter (gguf-py ``Keys``); facts a family's files do not state are set here, each with its source:

- gemma3: every 6th layer is global (``(i + 1) % 6 == 0``), the others slide over 512 cells; local RoPE base 10000
  (HF ``Gemma3TextConfig``: ``sliding_window_pattern = 6``, ``rope_local_base_freq = 10000``; llama.cpp
  ``LLM_ARCH_GEMMA3``). Token embeddings are scaled by sqrt(hidden); the GGUF norm weights already include +1.
- llama: the converter permutes Q/K rows so that RoPE rotates adjacent pairs ("normal"/interleaved RoPE in ggml).
- qwen2: NeoX (half-split) RoPE, Q/K/V biases.

Hybrid families (qwen35moe, qwen3next, qwen4exp) extend this config in `strata_jax.models` (their keys are read
there, next to the code that uses them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from strata_jax.errors import UnsupportedError
from strata_jax.gguf.metadata import get_array, get_float, get_int, key_error

DENSE_ARCHS = ("llama", "qwen2", "gemma3")
HYBRID_ARCHS = ("qwen35moe", "qwen3next", "qwen4exp")
SUPPORTED_ARCHS = DENSE_ARCHS + HYBRID_ARCHS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Geometry and numerics of a dense transformer (the fields every family shares).

    Attributes:
      arch: GGUF ``general.architecture``.
      n_layer: transformer blocks (trunk only).
      n_embd: hidden size.
      n_head / n_head_kv / head_dim: attention heads, KV heads (GQA), per-head width.
      n_ff: MLP width.
      vocab_size: rows of the embedding / head.
      rms_eps: RMSNorm epsilon.
      rope_theta: RoPE base of global layers; ``rope_theta_local`` of sliding-window layers.
      rope_dim: rotated dims per head (partial RoPE when < head_dim).
      rope_neox: True for half-split (NeoX) pairing, False for adjacent pairs.
      context_length: trained context.
      sliding_window: window of local layers (cells), or 0.
      layer_local: per layer, True if it uses the sliding window.
      tied_head: the head reuses ``token_embd``.
      attn_bias: Q/K/V projections have biases.
      qk_norm: per-head RMSNorm on q and k (gemma3).
      post_norms: gemma3's extra norms after attention and after the MLP.
      mlp_act: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU).
      embed_scale: multiplier of the token embedding (sqrt(n_embd) for gemma3, else 1).
      attn_scale: softmax scale (1/sqrt(head_dim) unless the family says otherwise).
      bos_id / eos_id: from the tokenizer metadata (-1 if absent).
    """

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    rope_neox: bool
    context_length: int
    sliding_window: int = 0
    layer_local: tuple[bool, ...] = ()
    rope_theta_local: float = 10000.0
    tied_head: bool = False
    attn_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    mlp_act: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float = 0.0
    bos_id: int = -1
    eos_id: int = -1
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)


# Ranges of the metadata counts (generous: real files stay far below; they keep a hostile file from sizing a huge
# allocation before any tensor is read).
MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 12
MAX_WIDTH = 1 << 20
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 16
MAX_TOKEN_ID = (1 << 31) - 1


def vocab_size(g, arch: str) -> int:
    """``{arch}.vocab_size``, else the tokenizer's token count, else the rows of ``token_embd``."""
    tokens = get_array(g, "tokenizer.ggml.tokens", None, of="str")
    vocab = get_int(g, arch + ".vocab_size", len(tokens) if tokens is not None else 0, min=1, max=MAX_VOCAB)
    if vocab == 0 and g.has("token_embd.weight"):
        vocab = g.info("token_embd.weight").shape[0]
    return vocab


def base_fields(g, *, n_layer: int, n_ff: int, rope_fraction: int = 1) -> dict[str, Any]:
    """The `ModelConfig` fields every family reads the same way from an open GGUF (``<arch>.`` keys of llama.cpp's
    converters): widths, heads, vocabulary, norm epsilon, RoPE base and width, context, tied head, special ids.

    Args:
      g: an open `GGUFFile`.
      n_layer: trunk layers (the hybrids' ``block_count`` minus their MTP layers).
      n_ff: the dense FFN width (0 for the MoE hybrids without one).
      rope_fraction: without ``rope.dimension_count`` RoPE turns ``head_dim // rope_fraction`` dimensions (the
        hybrids' partial RoPE: 4).

    Raises:
      StrataError: ``embedding_length`` or ``attention.head_count`` is missing, or a key has the wrong type or is
        out of range (`strata_jax.gguf.metadata`).
    """
    arch = g.architecture
    p = arch + "."
    n_embd = get_int(g, p + "embedding_length", min=1, max=MAX_WIDTH)
    n_head = get_int(g, p + "attention.head_count", min=1, max=MAX_HEADS)
    head_dim = get_int(g, p + "attention.key_length", n_embd // n_head, min=1, max=MAX_WIDTH)
    n_head_kv = get_int(g, p + "attention.head_count_kv", n_head, min=1, max=MAX_HEADS)
    rope_dim = get_int(g, p + "rope.dimension_count", head_dim // rope_fraction, min=0, max=MAX_WIDTH)
    # relations between the keys (what the attention layers assume)
    if head_dim < 1:
        raise key_error(g, p + "attention.head_count", f"at most {p}embedding_length ({n_embd})", n_head)
    if n_head % n_head_kv:
        raise key_error(g, p + "attention.head_count_kv", f"a divisor of {p}attention.head_count ({n_head})",
                        n_head_kv)
    if rope_dim > head_dim or rope_dim % 2:
        raise key_error(g, p + "rope.dimension_count", f"even and at most the head width ({head_dim})", rope_dim)
    return dict(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        vocab_size=vocab_size(g, arch),
        rms_eps=get_float(g, p + "attention.layer_norm_rms_epsilon", 1e-6, positive=True, max=1.0),
        rope_theta=get_float(g, p + "rope.freq_base", 10000.0, positive=True),
        rope_dim=rope_dim,
        context_length=get_int(g, p + "context_length", 4096, min=1, max=1 << 40),
        tied_head=not g.has("output.weight"),
        attn_scale=1.0 / math.sqrt(head_dim),
        bos_id=get_int(g, "tokenizer.ggml.bos_token_id", -1, min=-1, max=MAX_TOKEN_ID),
        eos_id=get_int(g, "tokenizer.ggml.eos_token_id", -1, min=-1, max=MAX_TOKEN_ID),
    )


def config_from_gguf(g) -> ModelConfig:
    """Build the `ModelConfig` of an open `GGUFFile`.

    Raises:
      UnsupportedError: an architecture outside `SUPPORTED_ARCHS`.
      StrataError: a required key is missing, or a key has the wrong type or is out of range.
    """
    arch, path = g.architecture, g.path
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    if arch in HYBRID_ARCHS:
        from strata_jax.models import hybrid_config_from_gguf  # the hybrid families read their own keys

        return hybrid_config_from_gguf(g)
    p = arch + "."
    kw = base_fields(g, n_layer=get_int(g, p + "block_count", min=1, max=MAX_LAYERS),
                     n_ff=get_int(g, p + "feed_forward_length", min=1, max=MAX_WIDTH))
    n_layer, n_embd, head_dim = kw["n_layer"], kw["n_embd"], kw["head_dim"]
    kw.update(rope_neox=arch != "llama", attn_bias=g.has("blk.0.attn_q.bias"))
    if arch == "gemma3":
        window = get_int(g, p + "attention.sliding_window", 512, min=1, max=1 << 40)
        kw.update(
            sliding_window=window,
            # HF Gemma3TextConfig: sliding_window_pattern 6 -> layer i is global iff (i + 1) % 6 == 0.
            layer_local=tuple((i + 1) % 6 != 0 for i in range(n_layer)),
            rope_theta_local=10000.0,  # HF Gemma3TextConfig.rope_local_base_freq
            qk_norm=True,
            post_norms=True,
            mlp_act="gelu_tanh",
            embed_scale=math.sqrt(n_embd),
            # HF Gemma3: query_pre_attn_scalar = 256 for the 270M model = head_dim.
            attn_scale=get_float(g, p + "attention.scale", 1.0 / math.sqrt(head_dim), positive=True),
        )
    else:
        kw["layer_local"] = (False,) * n_layer
    return ModelConfig(**kw)
