"""Hybrid MoE families: qwen35moe (Qwen3.5/3.6 MoE), qwen3next (Qwen3-Next); qwen4exp is not implemented yet.

Sources: HF transformers 5.24 ``modeling_qwen3_5_moe.py``, ``modeling_qwen3_next.py`` (numerics), llama.cpp's
converter ``conversion/qwen.py`` and graphs ``src/models/{qwen35moe,qwen3next}.cpp`` (GGUF names/keys), spec MODEL.md
Part B.

Block (plain pre-norm residual, every layer):
  ``h += mixer(attn_norm(h))`` with mixer = GDN (`strata_jax.layers.gdn`) on recurrent layers, gated attention
  (`strata_jax.layers.qsa.GatedAttention`) on every ``full_attention_interval``-th layer;
  ``h += MoE(post_attention_norm(h))`` (`strata_jax.layers.moe`). Head: ``output(output_norm(h))``.

State (``init_state``): ``{"layers": [per layer]}`` where a GDN layer holds ``{"S": f32 [n_slots, Hv, Dk, Dv],
"conv": f32 [n_slots, K-1, C]}`` and an attention layer ``(k_cache, v_cache)`` [n_slots, max_context + 1, Hkv, hd].
Window mode writes K/V cells and leaves the GDN state alone; ``pending`` holds, per GDN layer, the rows' conv inputs
and k, v, g, beta, and ``commit(state, pending, rows, keep)`` replays exactly ``keep[b]`` rows. Prefill commits all
valid rows (pending is None).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.config import ModelConfig
from strata_jax.errors import StrataError, UnsupportedError
from strata_jax.layers.gdn import GatedDeltaNet, qcall
from strata_jax.layers.linear import Embedding, QLinear, load_f32
from strata_jax.layers.moe import MoE
from strata_jax.layers.norms import RMSNorm
from strata_jax.layers.qsa import GatedAttention
from strata_jax.state import Rows


@dataclasses.dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """`ModelConfig` plus the hybrid geometry.

    Attributes:
      layer_recurrent: per trunk layer, True for a GDN layer, False for (gated/QSA) attention.
      ssm_k_heads / ssm_v_heads / ssm_d_k / ssm_d_v / ssm_conv: GDN geometry (GGUF ``ssm.group_count``,
        ``ssm.time_step_rank``, ``ssm.state_size``, ``ssm.inner_size / time_step_rank``, ``ssm.conv_kernel``).
      v_order: ``"tiled"`` (qwen35*/qwen4exp GGUFs) or ``"grouped"`` (qwen3next) v-head order.
      gdn_gate: ``"silu"`` or ``"sigmoid"`` (qwen4exp).
      n_expert / n_expert_used / expert_ff / shared_ff: MoE geometry.
      n_nextn: MTP blocks appended after the trunk (``nextn_predict_layers``).
    """

    layer_recurrent: tuple[bool, ...] = ()
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_d_k: int = 0
    ssm_d_v: int = 0
    ssm_conv: int = 4
    v_order: str = "tiled"
    gdn_gate: str = "silu"
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ff: int = 0
    shared_ff: int = 0
    n_nextn: int = 0


def _req(md, key, path):
    if key not in md:
        raise StrataError(f"{path}: GGUF metadata lacks {key!r}")
    return md[key]


def hybrid_config_from_gguf(g) -> HybridConfig:
    """The `HybridConfig` of an open qwen35moe / qwen3next GGUF (keys written by llama.cpp's converter, MODEL.md
    B§2.1).

    Raises:
      UnsupportedError: another architecture (qwen4exp is not implemented yet).
      StrataError: a required key is missing.
    """
    md, arch, path = g.metadata, g.architecture, g.path
    if arch not in ("qwen35moe", "qwen3next"):
        raise UnsupportedError(f"{path}: hybrid architecture {arch!r} is not implemented (qwen35moe, qwen3next)")
    p = arch + "."
    n_embd = int(_req(md, p + "embedding_length", path))
    n_head = int(_req(md, p + "attention.head_count", path))
    n_head_kv = int(md.get(p + "attention.head_count_kv", n_head))
    head_dim = int(md.get(p + "attention.key_length", n_embd // n_head))
    n_nextn = int(md.get(p + "nextn_predict_layers", 0))
    n_layer = int(_req(md, p + "block_count", path)) - n_nextn
    rec = md.get(p + "attention.recurrent_layers")
    if rec is not None:
        rec = tuple(bool(r) for r in list(rec)[:n_layer])
    else:
        interval = int(md.get(p + "full_attention_interval", 4))
        rec = tuple((i + 1) % interval != 0 for i in range(n_layer))
    v_heads = int(_req(md, p + "ssm.time_step_rank", path))
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = int(md.get(p + "vocab_size", len(tokens) if tokens is not None else 0))
    if vocab == 0:
        vocab = g.info("token_embd.weight").shape[0]
    return HybridConfig(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=int(md.get(p + "feed_forward_length", 0)),
        vocab_size=vocab,
        rms_eps=float(md.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(md.get(p + "rope.freq_base", 10000.0)),
        rope_dim=int(md.get(p + "rope.dimension_count", head_dim // 4)),
        rope_neox=True,
        context_length=int(md.get(p + "context_length", 4096)),
        layer_local=(False,) * n_layer,
        tied_head=not g.has("output.weight"),
        attn_scale=1.0 / math.sqrt(head_dim),
        bos_id=int(md.get("tokenizer.ggml.bos_token_id", -1)),
        eos_id=int(md.get("tokenizer.ggml.eos_token_id", -1)),
        layer_recurrent=rec,
        ssm_k_heads=int(_req(md, p + "ssm.group_count", path)),
        ssm_v_heads=v_heads,
        ssm_d_k=int(_req(md, p + "ssm.state_size", path)),
        ssm_d_v=int(_req(md, p + "ssm.inner_size", path)) // v_heads,
        ssm_conv=int(md.get(p + "ssm.conv_kernel", 4)),
        v_order="grouped" if arch == "qwen3next" else "tiled",
        gdn_gate="silu",
        n_expert=int(_req(md, p + "expert_count", path)),
        n_expert_used=int(_req(md, p + "expert_used_count", path)),
        expert_ff=int(md.get(p + "expert_feed_forward_length", 0)),
        shared_ff=int(md.get(p + "expert_shared_feed_forward_length", 0)),
        n_nextn=n_nextn,
    )


def head_logits(head, norm, h, rows: Rows, mode: str, which: str):
    """Logits float32 of every row (``which="all"``, [B, T, V]) or of each segment's last valid row (``"last"``,
    [B, 1, V]); as `strata_jax.models.dense.head_logits`."""
    if which == "last":
        idx = jnp.clip(rows.n_valid - 1, 0, h.shape[1] - 1)
        h = jnp.take_along_axis(h, idx[:, None, None], axis=1)
    return qcall(head, norm(h), mode == "window")


class HybridBlock(nnx.Module):
    """One trunk layer: pre-norm mixer (GDN or gated attention) + pre-norm MoE, plain residual."""

    def __init__(self, g, cfg: HybridConfig, i: int, device=None):
        p = f"blk.{i}."
        self.recurrent = bool(cfg.layer_recurrent[i])
        self.attn_norm = RMSNorm(load_f32(g, p + "attn_norm.weight", device), cfg.rms_eps)
        if self.recurrent:
            self.mixer = GatedDeltaNet(g, p, n_k_heads=cfg.ssm_k_heads, n_v_heads=cfg.ssm_v_heads, d_k=cfg.ssm_d_k,
                                       d_v=cfg.ssm_d_v, conv_kernel=cfg.ssm_conv, v_order=cfg.v_order,
                                       gate_act=cfg.gdn_gate, rms_eps=cfg.rms_eps, device=device)
        else:
            self.mixer = GatedAttention(g, p, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
                                        rope_dim=cfg.rope_dim, rope_theta=cfg.rope_theta, rms_eps=cfg.rms_eps,
                                        device=device)
        self.ffn_norm = RMSNorm(load_f32(g, p + "post_attention_norm.weight", device), cfg.rms_eps)
        self.moe = MoE(g, p, n_used=cfg.n_expert_used, renorm=True, device=device)

    def __call__(self, h, st, rows: Rows, mode: str, max_context: int):
        a = self.attn_norm(h)
        if self.recurrent:
            y, st, pend = self.mixer(a, st, rows, mode)
        else:
            y, st = self.mixer(a, st, rows, mode, max_context)
            pend = None
        h = h + y
        h = h + self.moe(self.ffn_norm(h), mode == "window")
        return h, st, pend

    def commit(self, st, pend, rows: Rows, keep):
        if self.recurrent:
            return self.mixer.commit(st, pend, rows, keep)
        return st


class HybridStage(nnx.Module):
    """Layers ``[start, stop)`` of a qwen35moe / qwen3next model (embedding on the first stage, final norm + head on
    the last): the Stage protocol of `strata_jax.models.dense.DenseStage`.

    ``__call__(state, x, rows, mode, max_context, logits="all") -> (out, state, pending)``: ``x`` int32 ids [B, T]
    (first stage) or float32 hidden [B, T, D]; ``mode`` "window" (T <= 8, GDN state untouched, ``pending`` = list per
    layer of the GDN rows' inputs or None) or "prefill" (all valid rows committed, ``pending`` None); ``out`` =
    {"hidden" [B, T, D], "logits" float32 [B, T, V] or [B, 1, V] (``logits="last"``) on the last stage}.
    ``commit(state, pending, rows, keep)`` advances each segment's slot by ``keep[b]`` rows.
    """

    def __init__(self, g, cfg: HybridConfig, start: int, stop: int, device=None):
        if not isinstance(cfg, HybridConfig):
            raise UnsupportedError(f"HybridStage needs a HybridConfig, got {type(cfg).__name__} for {cfg.arch!r}")
        self.cfg = cfg
        self.start, self.stop = start, stop
        self.first, self.last = start == 0, stop == cfg.n_layer
        self.embed = (Embedding.from_gguf(g, "token_embd.weight", device)
                      if self.first or (self.last and cfg.tied_head) else None)
        self.blocks = nnx.List([HybridBlock(g, cfg, i, device) for i in range(start, stop)])
        if self.last:
            self.out_norm = RMSNorm(load_f32(g, "output_norm.weight", device), cfg.rms_eps)
            self.head = self.embed.as_linear() if cfg.tied_head else QLinear.from_gguf(g, "output.weight", device)

    def init_state(self, n_slots: int, max_context: int, kv_dtype=jnp.float32, device=None):
        """Zero state for ``n_slots`` slots (see module docstring)."""
        cfg = self.cfg
        layers = []
        for blk in self.blocks:
            if blk.recurrent:
                shp = blk.mixer.state_shapes()
                layers.append({k: jax.device_put(jnp.zeros((n_slots,) + s, jnp.float32), device)
                               for k, s in shp.items()})
            else:
                shape = (n_slots, max_context + 1, cfg.n_head_kv, cfg.head_dim)
                layers.append((jax.device_put(jnp.zeros(shape, kv_dtype), device),
                               jax.device_put(jnp.zeros(shape, kv_dtype), device)))
        return {"layers": layers}

    def __call__(self, state, x, rows: Rows, mode: str, max_context: int, logits: str = "all"):
        if mode not in ("window", "prefill"):
            raise UnsupportedError(f"mode {mode!r} is not 'window' or 'prefill'")
        h = self.embed(x) if self.first else x.astype(jnp.float32)
        sts, pends = [], []
        for blk, st in zip(self.blocks, state["layers"]):
            h, st, pend = blk(h, st, rows, mode, max_context)
            sts.append(st)
            pends.append(pend)
        out = {"hidden": h}
        if self.last:
            out["logits"] = head_logits(self.head, self.out_norm, h, rows, mode, logits)
        return out, {"layers": sts}, (pends if mode == "window" else None)

    def commit(self, state, pending, rows: Rows, keep):
        """Advance each segment's slot by exactly ``keep[b]`` rows (int32 [B], 0..T) of the window that returned
        ``pending``; attention layers need nothing (their cells were written by the window)."""
        if pending is None:
            return state
        layers = [blk.commit(st, pend, rows, keep) for blk, st, pend in zip(self.blocks, state["layers"], pending)]
        return {"layers": layers}
