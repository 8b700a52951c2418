"""The configuration every model family shares, and the GGUF key reading all of them do the same way.

`ModelConfig` is the typed geometry and numerics of a model; each family (one file in `strata_jax.models`, looked up
by ``general.architecture`` in `strata_jax.models.registry`) reads its own ``{arch}.*`` keys into it, or into a
subclass with its extra fields, and writes down there the facts its files do not state. `base_fields` is the part
of that reading common to every family (llama.cpp's converters write these keys the same way for all of them).

`shape_dims` gives the config's widths as `Dim` s, ints that remember the keys they were read from: the layers state
each tensor's expected shape with them (as llama.cpp's ``create_tensor(name, {dims})``), and the loader's one check
(`strata_jax.layers.linear.check_tensor`) names those keys when a tensor disagrees.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

from strata_jax.errors import UnsupportedError
from strata_jax.gguf.metadata import get_array, get_float, get_int, get_str, key_error


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Geometry and numerics of a decoder-only transformer: the fields every family shares (a family with more
    subclasses it, e.g. `strata_jax.models.hybrid.HybridConfig`).

    Attributes:
      arch: GGUF ``general.architecture``.
      n_layer: transformer blocks (trunk only).
      n_embd: hidden size.
      n_head / n_head_kv / head_dim: attention heads, KV heads (GQA), per-head width.
      n_ff: MLP width (0 for the MoE families without a dense FFN).
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
      qk_norm: per-head RMSNorm on q and k before RoPE (gemma3, qwen3, qwen3moe).
      post_norms: gemma3's extra norms after attention and after the MLP.
      mlp_act: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU).
      embed_scale: multiplier of the token embedding (sqrt(n_embd) for gemma3, else 1).
      attn_scale: softmax scale (1/sqrt(head_dim) unless the family says otherwise).
      bos_id / eos_id: from the tokenizer metadata (-1 if absent).
      n_expert / n_expert_used / expert_ff / shared_ff: the MoE FFN (``expert_count``, ``expert_used_count``,
        ``expert_feed_forward_length``, ``expert_shared_feed_forward_length``); ``n_expert`` 0 = a dense SwiGLU/GeGLU
        FFN of width ``n_ff`` (`strata_jax.layers.mlp.make_ffn`).
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
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ff: int = 0
    shared_ff: int = 0
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


def refuse_rope_scaling(g) -> None:
    """Raise `UnsupportedError` when the file asks for RoPE scaling (``{arch}.rope.scaling.type`` other than
    ``none``, e.g. the YaRN that Qwen3 model cards suggest for contexts past 32K): llama.cpp applies it at every
    position, so running without it would give other logits, not just a shorter context."""
    kind = get_str(g, g.architecture + ".rope.scaling.type", "none") or "none"
    if kind != "none":
        raise UnsupportedError(f"{g.path}: RoPE scaling {kind!r} ({g.architecture}.rope.scaling.type) is not "
                               "implemented; use a file converted without rope_scaling")


class Dim(int):
    """An expected tensor dimension that remembers where it comes from: ``src``, texts such as
    ``"qwen3next.attention.head_count=4"``. Sums, products and floor quotients with ints or other Dims are Dims with
    the sources of both, so ``2 * d.n_head * d.head_dim`` names both keys. Equal to (and hashed as) its int value."""

    src: tuple[str, ...]

    def __new__(cls, value: int, src: tuple[str, ...] = ()):
        d = super().__new__(cls, value)
        d.src = tuple(src)
        return d

    def _with(self, other, value: int) -> "Dim":
        extra = getattr(other, "src", ())
        return Dim(value, self.src + tuple(s for s in extra if s not in self.src))

    def __add__(self, o):
        return self._with(o, int(self) + int(o)) if isinstance(o, int) else NotImplemented

    def __mul__(self, o):
        return self._with(o, int(self) * int(o)) if isinstance(o, int) else NotImplemented

    def __sub__(self, o):
        return self._with(o, int(self) - int(o)) if isinstance(o, int) else NotImplemented

    def __rsub__(self, o):
        return self._with(o, int(o) - int(self)) if isinstance(o, int) else NotImplemented

    def __floordiv__(self, o):
        return self._with(o, int(self) // int(o)) if isinstance(o, int) else NotImplemented

    __radd__ = __add__
    __rmul__ = __mul__


# The keys (after "<arch>.") each shape-giving field is read from, as alternatives: the first whose keys are all in
# the file is named (the fallbacks of base_fields, hybrid_fields and the families: head_dim = embedding_length /
# head_count without key_length, ...). Messages only; the reading itself is in those functions.
FIELD_KEYS: dict[str, tuple[tuple[str, ...], ...]] = {
    "n_embd": (("embedding_length",),),
    "n_head": (("attention.head_count",),),
    "n_head_kv": (("attention.head_count_kv",), ("attention.head_count",)),
    "head_dim": (("attention.key_length",), ("embedding_length", "attention.head_count")),
    "n_ff": (("feed_forward_length",),),
    "vocab_size": (("vocab_size",), ("tokenizer.ggml.tokens",)),
    "n_expert": (("expert_count",),),
    "expert_ff": (("expert_feed_forward_length",), ("feed_forward_length", "expert_used_count")),
    "shared_ff": (("expert_shared_feed_forward_length",),),
    "ssm_k_heads": (("ssm.group_count",),),
    "ssm_v_heads": (("ssm.time_step_rank",),),
    "ssm_d_k": (("ssm.state_size",),),
    "ssm_d_v": (("ssm.inner_size", "ssm.time_step_rank"),),
    "ssm_conv": (("ssm.conv_kernel",),),
    "hc": (("hyper_connection.count",),),
    "hc_lowrank": (("hyper_connection.low_rank",),),
    "idx_heads": (("attention.indexer.head_count",),),
    "idx_head_dim": (("attention.indexer.key_length",),),
    "ple_ngram": (("ple.ngram_size",),),
    "ple_heads_per_ngram": (("ple.heads_per_ngram",),),
    "ple_conv": (("ple.conv_kernel",),),
}


def _key_text(g, key: str) -> str:
    v = g.metadata[key]
    return f"{key} ({len(v)} entries)" if hasattr(v, "__len__") and not isinstance(v, str) else f"{key}={v}"


def _sources(g, arch: str, field: str, value: int) -> tuple[str, ...]:
    alts = FIELD_KEYS.get(field)
    if not alts:
        return ()
    full = lambda k: k if k.startswith("tokenizer.") else f"{arch}.{k}"
    for keys in alts:
        if all(full(k) in g.metadata for k in keys):
            return tuple(_key_text(g, full(k)) for k in keys)
    return (f"{full(alts[0][0])} absent: {value}",)


def shape_dims(g, cfg: ModelConfig) -> types.SimpleNamespace:
    """The integer fields of ``cfg`` as `Dim` s naming the GGUF keys they come from (`FIELD_KEYS`), for the expected
    tensor shapes of the layers (``shape=(d.n_head * d.head_dim, d.n_embd)``). A field that is 0 (a width the file
    does not state, e.g. ``expert_ff`` without ``expert_feed_forward_length``) is None: any size (no tensor dim is
    0, the reader refuses those)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, int) and not isinstance(v, bool):
            out[f.name] = Dim(v, _sources(g, cfg.arch, f.name, v)) if v else None
    return types.SimpleNamespace(**out)
