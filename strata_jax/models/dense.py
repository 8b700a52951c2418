"""The transformer stage shared by the attention-only families: llama, qwen2, gemma3, qwen3 (dense FFN) and qwen3moe
(MoE FFN). Each family's own file (`strata_jax.models.llama`, ...) reads its keys and states its conventions; this
file holds the block, the stage and `dense_fields`, the key reading they share.

Sources: HF transformers ``modeling_llama.py``, ``modeling_qwen2.py``, ``modeling_gemma3.py``, ``modeling_qwen3.py``,
``modeling_qwen3_moe.py``; llama.cpp's graphs ``src/models/{llama,qwen2,gemma3,qwen3,qwen3moe}.cpp`` for the GGUF
tensor names (``blk.N.attn_q``, ``ffn_gate``, ``ffn_gate_exps``, ...).

Block (pre-norm): ``h += [post_attn_norm](attn(attn_norm(h)))``; ``h += [post_ffw_norm](ffn(ffn_norm(h)))``, the
bracketed norms only for gemma3. With ``qk_norm`` (gemma3, qwen3, qwen3moe) q and k get a per-head RMSNorm before
RoPE. The FFN is `strata_jax.layers.mlp.make_ffn`'s: SwiGLU (``down(silu(gate x) * up x)``), GeGLU with tanh-GELU
(gemma3), or the routed experts (qwen3moe).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.config import MAX_LAYERS, MAX_WIDTH, ModelConfig, base_fields, shape_dims
from strata_jax.gguf.metadata import get_int
from strata_jax.layers.attention import attend_prefill, attend_window
from strata_jax.layers.linear import Embedding, QLinear, head_logits, load_f32, project_shared
from strata_jax.layers.mlp import make_ffn
from strata_jax.layers.norms import RMSNorm
from strata_jax.layers.rope import apply_rope
from strata_jax.layers.stack import group_runs
from strata_jax.state import Rows, kv_zeros, write_cells


def dense_fields(g, *, n_ff_key: str | None = "feed_forward_length") -> dict[str, Any]:
    """`strata_jax.config.base_fields` plus what the attention-only families read alike: ``block_count`` (no MTP
    layers), the FFN width (``n_ff_key``; None for a family without a dense FFN: n_ff = 0), Q/K/V biases (present iff
    ``blk.0.attn_q.bias`` is), no sliding window. A family updates the result and builds its config from it.

    Raises:
      StrataError: ``block_count``, ``n_ff_key``, ``embedding_length`` or ``attention.head_count`` is missing, or a
        key has the wrong type or is out of range (`strata_jax.gguf.metadata`).
    """
    p = g.architecture + "."
    n_layer = get_int(g, p + "block_count", min=1, max=MAX_LAYERS)
    n_ff = get_int(g, p + n_ff_key, min=1, max=MAX_WIDTH) if n_ff_key else 0
    kw = base_fields(g, n_layer=n_layer, n_ff=n_ff)
    kw.update(attn_bias=g.has("blk.0.attn_q.bias"), layer_local=(False,) * n_layer)
    return kw


class DenseBlock(nnx.Module):
    """One transformer block (see module docstring). State: this layer's K/V cache."""

    def __init__(self, g, cfg: ModelConfig, i: int, device=None):
        p = f"blk.{i}."
        self.cfg = cfg
        d = shape_dims(g, cfg)  # the expected tensor shapes (llama.cpp's create_tensor dims)
        D, q, kv = d.n_embd, d.n_head * d.head_dim, d.n_head_kv * d.head_dim
        norm = lambda name, n=D: RMSNorm(load_f32(g, p + name, device, shape=(n,)), cfg.rms_eps)
        # an array, not a static flag, so that local and global layers stack into one scanned run
        self.is_local = nnx.Param(jnp.asarray(bool(cfg.layer_local[i]) if cfg.layer_local else False))
        self.attn_norm = norm("attn_norm.weight")
        self.wq = QLinear.from_gguf(g, p + "attn_q.weight", device, p + "attn_q.bias", shape=(q, D))
        self.wk = QLinear.from_gguf(g, p + "attn_k.weight", device, p + "attn_k.bias", shape=(kv, D))
        self.wv = QLinear.from_gguf(g, p + "attn_v.weight", device, p + "attn_v.bias", shape=(kv, D))
        self.wo = QLinear.from_gguf(g, p + "attn_output.weight", device, shape=(D, q))
        self.q_norm = norm("attn_q_norm.weight", d.head_dim) if cfg.qk_norm else None
        self.k_norm = norm("attn_k_norm.weight", d.head_dim) if cfg.qk_norm else None
        self.post_attn_norm = norm("post_attention_norm.weight") if cfg.post_norms else None
        self.ffn_norm = norm("ffn_norm.weight")
        self.ffn = make_ffn(g, p, cfg, device)
        self.post_ffw_norm = norm("post_ffw_norm.weight") if cfg.post_norms else None

    def __call__(self, h, kv, layer, rows: Rows, mode: str, max_context: int):
        """h float32 [B, T, D]; kv = (k, v) caches [L_run, n_slots, max_context + 1, Hkv, Dh] of this layer's run,
        ``layer`` its index there. Returns (h, kv)."""
        cfg = self.cfg
        B, T, _ = h.shape
        ex = mode == "window"  # row-exact matmuls in windows; prefill chunks take the GEMM
        a = self.attn_norm(h)
        q, k, v = project_shared(a, (self.wq, self.wk, self.wv), ex)
        q = q.reshape(B, T, cfg.n_head, cfg.head_dim)
        k = k.reshape(B, T, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(B, T, cfg.n_head_kv, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        pos = rows.positions(T)
        local = self.is_local[...]
        # a constant where no layer is local: one cos/sin per step for all layers, not one per layer
        theta = jnp.where(local, cfg.rope_theta_local, cfg.rope_theta) if any(cfg.layer_local) else cfg.rope_theta
        q = apply_rope(q, pos, cfg.rope_dim, theta, cfg.rope_neox)
        k = apply_rope(k, pos, cfg.rope_dim, theta, cfg.rope_neox)
        kc, vc = kv
        kc = write_cells(kc, rows, k, max_context, layer)
        vc = write_cells(vc, rows, v, max_context, layer)
        attend = attend_window if mode == "window" else attend_prefill
        window = jnp.where(local, cfg.sliding_window, 0) if cfg.sliding_window else 0
        o = attend(q, kc[layer], vc[layer], rows, scale=cfg.attn_scale, max_context=max_context, window=window)
        o = self.wo(o.reshape(B, T, cfg.n_head * cfg.head_dim), ex)
        if self.post_attn_norm is not None:
            o = self.post_attn_norm(o)
        h, a = self.ffn_norm.add_norm(h, o)
        y = self.ffn(a, ex)
        if self.post_ffw_norm is not None:
            y = self.post_ffw_norm(y)
        return h + y, (kc, vc)


class DenseStage(nnx.Module):
    """Layers ``[start, stop)`` of an attention-only model, with the embedding if ``start == 0`` and the final norm + head if
    ``stop == n_layer``: what one device runs in a layer split (the whole model when unsplit).

    Stage protocol (shared by every family, see `strata_jax.pipeline.stages`):
      ``init_state(n_slots, max_context, kv_dtype)``; ``__call__(state, x, rows, mode, max_context) -> (out, state,
      pending)`` where ``x`` is int32 token ids [B, T] on the first stage or the handed-off hidden rows [B, T, D],
      ``mode`` is ``"window"`` (verify window: recurrent state untouched) or ``"prefill"`` (all valid rows
      committed), and ``out`` is ``{"hidden": [B, T, D]}`` plus ``"logits"`` [B, T, V] float32 on the last stage
      (``logits="last"``: [B, 1, V], each segment's last valid row);
      ``commit(state, pending, rows, keep) -> state``.
    """

    def __init__(self, g, cfg: ModelConfig, start: int, stop: int, device=None):
        self.cfg = cfg
        self.start, self.stop = start, stop
        self.first, self.last = start == 0, stop == cfg.n_layer
        d = shape_dims(g, cfg)
        self.embed = (Embedding.from_gguf(g, "token_embd.weight", device, cfg.embed_scale,
                                          shape=(d.vocab_size, d.n_embd))
                      if self.first or (self.last and cfg.tied_head) else None)
        self.runs = nnx.List(group_runs([DenseBlock(g, cfg, i, device) for i in range(start, stop)]))
        if self.last:
            self.out_norm = RMSNorm(load_f32(g, "output_norm.weight", device, shape=(d.n_embd,)), cfg.rms_eps)
            if cfg.tied_head:
                self.head = self.embed.as_linear()
            else:
                self.head = QLinear.from_gguf(g, "output.weight", device, shape=(d.vocab_size, d.n_embd))

    def init_state(self, n_slots: int, max_context: int, kv_dtype=jnp.float32, device=None):
        cfg = self.cfg
        shape = (n_slots, max_context + 1, cfg.n_head_kv, cfg.head_dim)

        def z(n):
            return jax.device_put(kv_zeros((n,) + shape, kv_dtype, device), device)

        return {"kv": [(z(r.n), z(r.n)) for r in self.runs]}

    def __call__(self, state, x, rows: Rows, mode: str, max_context: int, logits: str = "all"):
        h = self.embed(x) if self.first else x.astype(jnp.float32)
        kvs = []
        for run, kv in zip(self.runs, state["kv"]):
            def body(blk, carry, i, _):
                h, kv = carry
                return blk(h, kv, i, rows, mode, max_context), None

            (h, kv), _ = run.scan(body, (h, kv))
            kvs.append(kv)
        out = {"hidden": h}
        if self.last:
            out["logits"] = head_logits(self.head, self.out_norm, h, rows, mode, logits)
        return out, {"kv": kvs}, None

    def commit(self, state, pending, rows: Rows, keep):
        """Dense layers hold no recurrent state: K/V were written by the window; nothing to advance."""
        return state
