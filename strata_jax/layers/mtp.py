"""MTP (multi-token prediction) draft layers of the hybrid families.

HF transformers has no Qwen MTP module (the Qwen classes drop ``mtp.*`` on load) and llama.cpp's
``draft-mtp`` was not compiled here, so these layers follow the spec and llama.cpp's graph description; they are
checked against a float64 numpy reference written from the spec (``tests/test_mtp.py``), and qwen35's block, exported
by llama.cpp's converter, against the same block assembled from HF's own modules (``tests/test_relatives.py``).

qwen35moe / qwen3next / qwen35 ``nextn`` block (`NextNMTP`; llama.cpp ``graph_mtp``):
GGUF tensors in block ``n = n_layer`` (the trunk's layer count): ``blk.n.nextn.{eh_proj,enorm,hnorm,
shared_head_norm}`` plus a gated-attention block with the trunk's kind of FFN (MoE; qwen35: SwiGLU
``ffn_{gate,up,down}``) ``blk.n.{attn_norm,attn_q,attn_k,attn_v,attn_output,attn_q_norm,attn_k_norm,
post_attention_norm,ffn_*}``; optional ``nextn.embed_tokens`` / ``nextn.shared_head_head`` (else ``token_embd`` and
``output`` / the tied embedding). For an MTP cell at position i (the position of the trunk row that made ``h``):
  ``x = eh_proj(concat(enorm(emb(tok_{i+1})), hnorm(h_i)))`` (embedding first);
  ``x += attn(attn_norm(x))`` (own K/V cache, RoPE at i); ``x += ffn(post_attention_norm(x))``;
  ``h' = shared_head_norm(x)``; ``logits = head(h')`` (predicts the token at i+2).
``h`` is the trunk's **post-final-norm** hidden (``out["mtp_hidden"]`` of the last `HybridStage`); ``h'`` (same
convention) is what the next chained draft consumes.

qwen4exp MTP (`HCMTP`): the cell combines the trunk's final 4-stream residual ``R_i`` (before the
final mixer; ``out["mtp_hidden"]``) with the token at i+1:
  ``e = fc_embedding(RMSNorm(emb(tok)) * w_e)``; ``h = fc_hidden(RMSNorm_over_all_hc*D(R) * w_h)`` applied per stream;
  ``R' = h + e`` (e broadcast over the streams); one QSA-type decoder layer (hyper-connections, gated attention with
  its own K/V -- dense, no indexer, as the reference runtime --, MoE); the trunk's final mixer ``output_hc_*`` and the
  shared head. ``R'`` after the layer is the next draft's input. No converter writes qwen4exp MTP tensors (llama.cpp's
  ``conversion/qwen4exp.py`` sets ``no_mtp``), so the GGUF names are this engine's convention, by analogy with
  ``nextn``: ``blk.n.nextn.{enorm,hnorm,fc_embedding,fc_hidden}.weight`` (norm weights with the +1 folded in,
  ``hnorm`` of length hc*D) and the block's tensors under ``blk.n.`` as in a trunk QSA layer.

Interface (both; built by `strata_jax.models.registry.mtp_head` from the family's ``Family.mtp``):
``__init__(g, cfg, device=None, reuse=None)`` (``reuse``: the trunk's head / embedding modules already on the device,
shared instead of loaded twice); ``init_state(n_slots, max_context)`` -> the MTP layer's K/V cache;
``draft(state, h_rows, tokens, rows, mode="window") -> (logits [B, T, V] float32, new_h, state)``; rows at
positions i carry ``h_i`` and the token at i+1. Window mode computes each row alone (row exact); the K/V cells of
rejected rows are overwritten when those positions are drafted again. There is no recurrent state, so no commit.
Chaining: feed ``new_h[:, -1:]`` with the drafted token at the next position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.config import shape_dims
from strata_jax.errors import StrataError
from strata_jax.layers.gdn import qcall
from strata_jax.layers.hyper import hc_write, hyper_read
from strata_jax.layers.linear import Embedding, QLinear, load_f32
from strata_jax.layers.mlp import make_ffn
from strata_jax.layers.norms import RMSNorm, rms_norm
from strata_jax.layers.qsa import GatedAttention
from strata_jax.state import Rows


def _attention(g, cfg, p, device):
    d = shape_dims(g, cfg)
    return GatedAttention(g, p, dim=d.n_embd, n_head=d.n_head, n_head_kv=d.n_head_kv, head_dim=d.head_dim,
                          rope_dim=cfg.rope_dim, rope_theta=cfg.rope_theta, rms_eps=cfg.rms_eps, indexer=None,
                          device=device)


def _head(g, cfg, p, device, reuse):
    d = shape_dims(g, cfg)
    if g.has(p + "nextn.shared_head_head.weight"):
        return QLinear.from_gguf(g, p + "nextn.shared_head_head.weight", device, shape=(d.vocab_size, d.n_embd))
    if g.has("output.weight"):
        if "output.weight" in reuse:  # the trunk's head, already on this device: the same buffer, no copy
            h = reuse["output.weight"]
            return QLinear(nnx.Param(h.w[...]), h.qtype, h.n_out, h.n_in)
        return QLinear.from_gguf(g, "output.weight", device, shape=(d.vocab_size, d.n_embd))
    return _embed(g, cfg, p, device, reuse, own=False).as_linear()


def _embed(g, cfg, p, device, reuse, own: bool = True):
    d = shape_dims(g, cfg)
    name = p + "nextn.embed_tokens.weight"
    if own and g.has(name):
        return Embedding.from_gguf(g, name, device, shape=(d.vocab_size, d.n_embd))
    if "token_embd.weight" in reuse:
        e = reuse["token_embd.weight"]
        return Embedding(e.w[...], e.qtype, e.vocab, e.dim)
    return Embedding.from_gguf(g, "token_embd.weight", device, shape=(d.vocab_size, d.n_embd))


class _Base(nnx.Module):
    def init_state(self, n_slots: int, max_context: int, kv_dtype=jnp.float32, device=None):
        """The MTP layer's own K/V cache: (k, v) [n_slots, max_context + 1, Hkv, hd]."""
        shape = (n_slots, max_context + 1, self.attn.Hkv, self.attn.hd)
        return (jax.device_put(jnp.zeros(shape, kv_dtype), device), jax.device_put(jnp.zeros(shape, kv_dtype), device))

    def _attend(self, x, state, rows: Rows, mode: str):
        max_context = state[0].shape[1] - 1
        return self.attn(x, state, rows, mode, max_context)


class NextNMTP(_Base):
    """qwen35moe / qwen3next / qwen35 ``nextn`` draft block (module docstring).

    Args: g: the open GGUF (holding block ``n_layer``); cfg: its `HybridConfig`; device.
    """

    def __init__(self, g, cfg, device=None, reuse: dict | None = None):
        reuse = reuse or {}
        n = cfg.n_layer
        p = f"blk.{n}."
        if not g.has(p + "nextn.eh_proj.weight"):
            raise StrataError(f"{g.path}: no MTP block (tensor {p}nextn.eh_proj.weight missing)")
        D = shape_dims(g, cfg).n_embd
        self.eh_proj = QLinear.from_gguf(g, p + "nextn.eh_proj.weight", device, shape=(D, 2 * D))
        self.enorm = RMSNorm(load_f32(g, p + "nextn.enorm.weight", device, shape=(D,)), cfg.rms_eps)
        self.hnorm = RMSNorm(load_f32(g, p + "nextn.hnorm.weight", device, shape=(D,)), cfg.rms_eps)
        shn = p + "nextn.shared_head_norm.weight"
        self.head_norm = RMSNorm(load_f32(g, shn if g.has(shn) else "output_norm.weight", device, shape=(D,)),
                                 cfg.rms_eps)
        self.embed = _embed(g, cfg, p, device, reuse)
        self.head = _head(g, cfg, p, device, reuse)
        self.attn_norm = RMSNorm(load_f32(g, p + "attn_norm.weight", device, shape=(D,)), cfg.rms_eps)
        self.attn = _attention(g, cfg, p, device)
        self.ffn_norm = RMSNorm(load_f32(g, p + "post_attention_norm.weight", device, shape=(D,)), cfg.rms_eps)
        self.ffn = make_ffn(g, p, cfg, device)

    def draft(self, state, h_rows, tokens, rows: Rows, mode: str = "window"):
        """h_rows float32 [B, T, D] (post-final-norm trunk hidden, or a previous draft's new_h); tokens int32 [B, T]
        (the token after each h row); rows: positions of the h rows. Returns (logits [B, T, V], new_h [B, T, D],
        state)."""
        exact = mode == "window"
        e = self.enorm(self.embed(tokens))
        hh = self.hnorm(h_rows.astype(jnp.float32))
        x = qcall(self.eh_proj, jnp.concatenate([e, hh], axis=-1), exact)
        y, state = self._attend(self.attn_norm(x), state, rows, mode)
        x = x + y
        x = x + self.ffn(self.ffn_norm(x), exact)
        new_h = self.head_norm(x)
        return qcall(self.head, new_h, exact), new_h, state


class HCMTP(_Base):
    """qwen4exp MTP layer (module docstring; tensor names are this engine's convention).

    Args: g; cfg: the qwen4exp `HybridConfig`; device.
    """

    def __init__(self, g, cfg, device=None, reuse: dict | None = None):
        reuse = reuse or {}
        n = cfg.n_layer
        p = f"blk.{n}."
        if not g.has(p + "nextn.fc_hidden.weight"):
            raise StrataError(f"{g.path}: no qwen4exp MTP layer (tensor {p}nextn.fc_hidden.weight missing)")
        self.hc, self.eps = cfg.hc, cfg.rms_eps
        d = shape_dims(g, cfg)
        D = d.n_embd
        self.enorm = nnx.Param(load_f32(g, p + "nextn.enorm.weight", device, shape=(D,)))
        self.hnorm = nnx.Param(load_f32(g, p + "nextn.hnorm.weight", device, shape=(d.hc * D,)))
        self.fc_e = QLinear.from_gguf(g, p + "nextn.fc_embedding.weight", device, shape=(D, D))
        self.fc_h = QLinear.from_gguf(g, p + "nextn.fc_hidden.weight", device, shape=(D, D))
        self.embed = _embed(g, cfg, p, device, reuse)
        self.head = _head(g, cfg, p, device, reuse)
        self.hc_attn = hyper_read(g, cfg, p + "hc_attn_", device)
        self.hc_ffn = hyper_read(g, cfg, p + "hc_ffn_", device)
        self.attn = _attention(g, cfg, p, device)
        self.moe = make_ffn(g, p, cfg, device)
        self.out_hc = hyper_read(g, cfg, "output_hc_", device, inject=False)

    def draft(self, state, h_rows, tokens, rows: Rows, mode: str = "window"):
        """h_rows float32 [B, T, hc, D] (the trunk's final residual streams, or a previous draft's new_h); tokens
        int32 [B, T]. Returns (logits [B, T, V], new_h [B, T, hc, D], state)."""
        exact = mode == "window"
        B, T, hc, D = h_rows.shape
        e = qcall(self.fc_e, rms_norm(self.embed(tokens), self.enorm[...], self.eps), exact)
        flat = rms_norm(h_rows.astype(jnp.float32).reshape(B, T, hc * D), self.hnorm[...], self.eps)
        R = qcall(self.fc_h, flat.reshape(B, T, hc, D), exact) + e[:, :, None, :]
        mixed, inj = self.hc_attn(R, exact)
        y, state = self._attend(mixed, state, rows, mode)
        R, mixed, inj = self.hc_ffn.after_write(R, y, inj, exact)  # the write and the read's norm: one launch
        R = hc_write(R, self.moe(mixed, exact), inj)
        mixed, _ = self.out_hc(R, exact)
        return qcall(self.head, mixed, exact), R, state
