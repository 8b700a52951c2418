"""The stage shared by the hybrid families: qwen35moe (Qwen3.5/3.6 MoE), qwen35 (Qwen3.5 dense), qwen3next
(Qwen3-Next), qwen4exp (Qwen3.8-Flash-Next). Each family's own file (`strata_jax.models.qwen35moe`, ...) reads its
keys into a `HybridConfig` (with `hybrid_fields`, the reading they share) and states its conventions and traps.

Sources: HF transformers 5.24 ``modeling_qwen3_5_moe.py``, ``modeling_qwen3_5.py``, ``modeling_qwen3_next.py``,
``modeling_qwen4_exp.py`` (numerics; HF wins where the spec disagrees), llama.cpp's converters
``conversion/{qwen,qwen4exp}.py`` and graphs ``src/models/{qwen35moe,qwen35,qwen3next}.cpp`` (GGUF names/keys),
HF transformers' and llama.cpp's qwen4exp, qwen3next and qwen35moe code.

qwen4exp (`HCBlock`): the residual is ``R`` float32 [B, T, hc, D] (the embedding tiled into the hc
streams); per layer ``[R += PLE(R, emb)]`` (PLE layers only), then ``mixed, inj = hc_attn(R)``, ``R += mixer(mixed) *
inj``, ``mixed, inj = hc_ffn(R)`` (the write before it and this read's norm in one launch: `GatedResidual.after_write`),
``R += MoE(mixed) * inj`` (`strata_jax.layers.hyper`); no attn/ffn norms.
Mixers: GDN with a sigmoid output gate, or gated attention with the QSA indexer (`strata_jax.layers.qsa`). Head:
``output(output_hc(R))`` (a hyper-connection read without inject; no output_norm). Extra per-row input: the PLE
table rows (``ple=`` of `HybridStage.__call__`), gathered on the host by `strata_jax.layers.ple.PLETable`.

Block of qwen35moe / qwen35 / qwen3next (`HybridBlock`, plain pre-norm residual, every layer):
  ``h += mixer(attn_norm(h))`` with mixer = GDN (`strata_jax.layers.gdn`) on recurrent layers, gated attention
  (`strata_jax.layers.qsa.GatedAttention`) on every ``full_attention_interval``-th layer;
  ``h += ffn(post_attention_norm(h))`` with ffn = MoE (`strata_jax.layers.moe`; qwen35moe, qwen3next) or a SwiGLU
  MLP (`strata_jax.layers.mlp`; qwen35). Head: ``output(output_norm(h))``.

State per layer (``init_state``): a GDN layer holds ``{"S": f32 [n_slots, Hv, Dk, Dv], "conv": f32 [n_slots, K-1,
C]}``, an attention layer ``(k_cache, v_cache)`` [n_slots, max_context + 1, Hkv, hd] (+ the raw indexer-key cache
[n_slots, max_context + 1, dI] on qwen4exp QSA layers); qwen4exp wraps it as ``{"mix": ..., ["ple": f32 [n_slots,
(K-1)*ngram, hc*D]]}``. The stage holds them per scanned run of periods (`HybridStage`). Window mode writes K/V and
indexer-key cells and leaves the GDN state and the PLE conv history alone; ``pending`` holds, per GDN layer, the rows'
conv inputs and k, v, g, beta (and the PLE layer's normed conv inputs), and ``commit(state, pending, rows, keep)``
replays exactly ``keep[b]`` rows. Prefill commits all valid rows (pending is None).

Unused by the stage: ``out["mtp_hidden"]`` feeds the family's MTP draft layer (`strata_jax.layers.mtp`, built
separately from the same GGUF by `strata_jax.models.registry.mtp_head`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.config import (MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_WIDTH, Dim, ModelConfig, base_fields,
                               shape_dims)
from strata_jax.gguf.metadata import get_array, get_int, key_error
from strata_jax.errors import StrataError, UnsupportedError
from strata_jax.layers.gdn import GatedDeltaNet, conv_tail
from strata_jax.layers.hyper import hc_write, hyper_read
from strata_jax.layers.linear import Embedding, QLinear, check_tensor, head_logits, load_f32
from strata_jax.layers.mlp import make_ffn
from strata_jax.layers.norms import RMSNorm
from strata_jax.layers.ple import TABLE as PLE_TABLE, PLEBlock, PLETable, dequant_rows
from strata_jax.layers.qsa import GatedAttention
from strata_jax.layers.stack import group_runs
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
      n_nextn: MTP blocks appended after the trunk (``nextn_predict_layers``).
      hc / hc_lowrank: qwen4exp hyper-connection streams and rank (0 = plain residual).
      idx_heads / idx_head_dim / idx_budget / idx_ratio: qwen4exp QSA indexer (``attention.indexer.head_count``,
        ``.key_length``, ``.top_k`` (cells), ``attention.compress_ratios`` per layer, 0 on GDN layers).
      ple_layers: 0-based layers with a PLE block (``ple.layers``); ple_*: the ``ple.*`` keys (ngram size, heads per
        n-gram, conv kernel, eos, multipliers, head vocab sizes and offsets).
    """

    layer_recurrent: tuple[bool, ...] = ()
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_d_k: int = 0
    ssm_d_v: int = 0
    ssm_conv: int = 4
    v_order: str = "tiled"
    gdn_gate: str = "silu"
    n_nextn: int = 0
    hc: int = 0
    hc_lowrank: int = 0
    idx_heads: int = 0
    idx_head_dim: int = 0
    idx_budget: int = 0
    idx_ratio: tuple[int, ...] = ()
    ple_layers: tuple[int, ...] = ()
    ple_ngram: int = 3
    ple_heads_per_ngram: int = 0
    ple_conv: int = 4
    ple_eos: int = -1
    ple_mult: tuple[int, ...] = ()
    ple_sizes: tuple[int, ...] = ()
    ple_offsets: tuple[int, ...] = ()


def hybrid_fields(g, *, moe: bool) -> dict:
    """The `HybridConfig` fields every hybrid family reads alike (llama.cpp's converters write them the same way,
    llama.cpp's converter): `strata_jax.config.base_fields` (partial RoPE: ``head_dim / 4`` rotated dims without
    ``rope.dimension_count``), the trunk's layer count (``block_count`` minus ``nextn_predict_layers``, the MTP
    blocks appended after the trunk), which layers are recurrent (``attention.recurrent_layers``, else every
    ``full_attention_interval``-th layer is attention), the GDN geometry (``ssm.*``), and the FFN: the MoE keys
    (``moe=True``) or ``feed_forward_length``. The family adds its own fields (GDN value order and gate, ...).

    Raises:
      StrataError: a required key is missing, or a key has the wrong type or is out of range
        (`strata_jax.gguf.metadata`), or the GDN keys disagree (``ssm.inner_size`` a multiple of
        ``ssm.time_step_rank``, ``ssm.group_count`` a divisor of it).
    """
    p = g.architecture + "."
    n_nextn = get_int(g, p + "nextn_predict_layers", 0, min=0, max=MAX_LAYERS)
    n_layer = get_int(g, p + "block_count", min=n_nextn + 1, max=MAX_LAYERS + n_nextn) - n_nextn
    n_ff = (get_int(g, p + "feed_forward_length", 0, min=0, max=MAX_WIDTH) if moe else
            get_int(g, p + "feed_forward_length", min=1, max=MAX_WIDTH))
    kw = base_fields(g, n_layer=n_layer, n_ff=n_ff, rope_fraction=4)
    rec = get_array(g, p + "attention.recurrent_layers", None, of="bool", min_length=n_layer)
    if rec is not None:
        rec = rec[:n_layer]
    else:
        interval = get_int(g, p + "full_attention_interval", 4, min=1, max=MAX_LAYERS)
        rec = tuple((i + 1) % interval != 0 for i in range(n_layer))
    v_heads = get_int(g, p + "ssm.time_step_rank", min=1, max=MAX_HEADS)
    ssm_k_heads = get_int(g, p + "ssm.group_count", min=1, max=MAX_HEADS)
    inner = get_int(g, p + "ssm.inner_size", min=1, max=MAX_WIDTH)
    # relations between the keys (what the GDN layer assumes)
    if inner % v_heads:
        raise key_error(g, p + "ssm.inner_size", f"a multiple of {p}ssm.time_step_rank ({v_heads})", inner)
    if v_heads % ssm_k_heads:
        raise key_error(g, p + "ssm.group_count", f"a divisor of {p}ssm.time_step_rank ({v_heads})", ssm_k_heads)
    kw.update(
        rope_neox=True,
        layer_local=(False,) * n_layer,
        layer_recurrent=rec,
        ssm_k_heads=ssm_k_heads,
        ssm_v_heads=v_heads,
        ssm_d_k=get_int(g, p + "ssm.state_size", min=1, max=MAX_WIDTH),
        ssm_d_v=inner // v_heads,
        ssm_conv=get_int(g, p + "ssm.conv_kernel", 4, min=1, max=1 << 10),
        n_nextn=n_nextn,
    )
    if moe:
        n_expert = get_int(g, p + "expert_count", min=1, max=MAX_EXPERTS)
        kw.update(
            n_expert=n_expert,
            n_expert_used=get_int(g, p + "expert_used_count", min=1, max=n_expert),
            expert_ff=get_int(g, p + "expert_feed_forward_length", 0, min=0, max=MAX_WIDTH),
            shared_ff=get_int(g, p + "expert_shared_feed_forward_length", 0, min=0, max=MAX_WIDTH),
        )
    return kw


def make_mixer(g, cfg: HybridConfig, i: int, device=None):
    """Layer i's mixer: GDN or gated attention (with the QSA indexer where ``idx_ratio[i] > 0``)."""
    p = f"blk.{i}."
    d = shape_dims(g, cfg)  # the tensors' expected shapes
    if cfg.layer_recurrent[i]:
        return GatedDeltaNet(g, p, dim=d.n_embd, n_k_heads=d.ssm_k_heads, n_v_heads=d.ssm_v_heads, d_k=d.ssm_d_k,
                             d_v=d.ssm_d_v, conv_kernel=d.ssm_conv, v_order=cfg.v_order, gate_act=cfg.gdn_gate,
                             rms_eps=cfg.rms_eps, device=device)
    ratio = cfg.idx_ratio[i] if i < len(cfg.idx_ratio) else 0
    # a layer with a compress ratio needs its indexer tensors (llama.cpp requires them on every attention layer)
    indexer = (dict(n_heads=d.idx_heads, head_dim=d.idx_head_dim, ratio=ratio, budget=cfg.idx_budget)
               if ratio > 0 else None)
    return GatedAttention(g, p, dim=d.n_embd, n_head=d.n_head, n_head_kv=d.n_head_kv, head_dim=d.head_dim,
                          rope_dim=cfg.rope_dim, rope_theta=cfg.rope_theta, rms_eps=cfg.rms_eps, indexer=indexer,
                          device=device)


def mixer_state(mixer, cfg: HybridConfig, n_slots: int, max_context: int, kv_dtype, device):
    """Zero state of one mixer (see the module docstring)."""
    if isinstance(mixer, GatedDeltaNet):
        return {k: jax.device_put(jnp.zeros((n_slots,) + s, jnp.float32), device)
                for k, s in mixer.state_shapes().items()}
    shape = (n_slots, max_context + 1, cfg.n_head_kv, cfg.head_dim)
    kv = (jax.device_put(jnp.zeros(shape, kv_dtype), device), jax.device_put(jnp.zeros(shape, kv_dtype), device))
    if mixer.indexer is not None:
        kv = kv + (jax.device_put(jnp.zeros((n_slots, max_context + 1, mixer.indexer.hd), jnp.float32), device),)
    return kv


class HybridBlock(nnx.Module):
    """One trunk layer: pre-norm mixer (GDN or gated attention) + pre-norm FFN (MoE or SwiGLU MLP), plain
    residual."""

    def __init__(self, g, cfg: HybridConfig, i: int, device=None):
        p = f"blk.{i}."
        D = shape_dims(g, cfg).n_embd
        self.recurrent = bool(cfg.layer_recurrent[i])
        self.attn_norm = RMSNorm(load_f32(g, p + "attn_norm.weight", device, shape=(D,)), cfg.rms_eps)
        self.mixer = make_mixer(g, cfg, i, device)
        self.ffn_norm = RMSNorm(load_f32(g, p + "post_attention_norm.weight", device, shape=(D,)), cfg.rms_eps)
        self.ffn = make_ffn(g, p, cfg, device)

    def __call__(self, h, st, rows: Rows, mode: str, max_context: int, ple_emb=None):
        a = self.attn_norm(h)
        if self.recurrent:
            y, st, pend = self.mixer(a, st, rows, mode)
        else:
            y, st = self.mixer(a, st, rows, mode, max_context)
            pend = None
        h, a = self.ffn_norm.add_norm(h, y)   # the residual add and the norm: one launch, their bits
        h = h + self.ffn(a, mode == "window")
        return h, st, pend

    def commit(self, st, pend, rows: Rows, keep):
        if self.recurrent:
            return self.mixer.commit(st, pend, rows, keep)
        return st


class HCBlock(nnx.Module):
    """One qwen4exp layer (module docstring): [PLE] + hyper-connection reads/writes around the mixer and the MoE.

    State: ``{"mix": mixer state}`` plus ``"ple"`` float32 [n_slots, (K-1)*ngram, hc*D] (the last normed PLE conv
    inputs) on the PLE layer. Pending (window mode): ``{"mix": GDN pending or None, "ple": normed rows or None}``.
    """

    def __init__(self, g, cfg: HybridConfig, i: int, device=None):
        p = f"blk.{i}."
        self.recurrent = bool(cfg.layer_recurrent[i])
        self.hc_attn = hyper_read(g, cfg, p + "hc_attn_", device)
        self.hc_ffn = hyper_read(g, cfg, p + "hc_ffn_", device)
        self.mixer = make_mixer(g, cfg, i, device)
        self.moe = make_ffn(g, p, cfg, device)
        ple = None
        if i in cfg.ple_layers:
            d = shape_dims(g, cfg)
            cols = check_tensor(g, PLE_TABLE, (None, None))[1]  # the table's rows are checked by the config
            emb = (d.ple_ngram - 1) * d.ple_heads_per_ngram * Dim(cols, (f"{PLE_TABLE} columns={cols}",))
            ple = PLEBlock(g, p, hc=d.hc, dim=d.n_embd, emb=emb, conv_kernel=d.ple_conv, dilation=cfg.ple_ngram,
                           eps=cfg.rms_eps, device=device)
        self.ple = ple

    def __call__(self, R, st, rows: Rows, mode: str, max_context: int, ple_emb=None):
        exact = mode == "window"
        new_st, pend = dict(st), {"mix": None, "ple": None}
        if self.ple is not None:
            if ple_emb is None:
                raise StrataError("this stage holds the PLE layer: pass the table rows (ple=...)")
            hist = st["ple"][rows.slot]
            upd, normed = self.ple(R, ple_emb, hist, exact)
            R = R + upd
            if exact:
                pend["ple"] = normed
            else:
                new_st["ple"] = st["ple"].at[rows.slot].set(conv_tail(hist, normed, rows.n_valid))
        mixed, inj = self.hc_attn(R, exact)
        if self.recurrent:
            y, new_st["mix"], pend["mix"] = self.mixer(mixed, st["mix"], rows, mode)
        else:
            y, new_st["mix"] = self.mixer(mixed, st["mix"], rows, mode, max_context)
        R, mixed, inj = self.hc_ffn.after_write(R, y, inj, exact)  # the write and the read's norm: one launch
        R = hc_write(R, self.moe(mixed, exact), inj)
        return R, new_st, pend

    def commit(self, st, pend, rows: Rows, keep):
        st = dict(st)
        if self.recurrent:
            st["mix"] = self.mixer.commit(st["mix"], pend["mix"], rows, keep)
        if self.ple is not None:
            st["ple"] = st["ple"].at[rows.slot].set(conv_tail(st["ple"][rows.slot], pend["ple"],
                                                              jnp.asarray(keep, jnp.int32)))
        return st


class Period(nnx.Module):
    """Consecutive layers run as one unit (a period of the GDN/attention pattern), so that identical periods stack
    into one scanned `strata_jax.layers.stack.LayerRun`. State and pending: lists over its layers."""

    def __init__(self, blocks: list):
        self.blocks = nnx.List(blocks)

    def __call__(self, h, sts, rows: Rows, mode: str, max_context: int, ple_emb=None):
        new, pends = [], []
        for blk, st in zip(self.blocks, sts):
            h, st, pend = blk(h, st, rows, mode, max_context, ple_emb)
            new.append(st)
            pends.append(pend)
        return h, new, pends

    def commit(self, sts, pends, rows: Rows, keep):
        return [blk.commit(st, pend, rows, keep) for blk, st, pend in zip(self.blocks, sts, pends)]


def _period(cfg: HybridConfig) -> int:
    """Layers per period: the distance between attention layers (``full_attention_interval``), else 1."""
    att = [i for i, r in enumerate(cfg.layer_recurrent) if not r]
    return att[1] - att[0] if len(att) > 1 else max(len(cfg.layer_recurrent), 1)


def _take(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _put(tree, i, new):
    return jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), i, 0), tree, new)


class HybridStage(nnx.Module):
    """Layers ``[start, stop)`` of a qwen35moe / qwen35 / qwen3next / qwen4exp model (embedding on the first stage, final
    norm / mixer + head on the last): the Stage protocol of `strata_jax.models.dense.DenseStage`.

    ``__call__(state, x, rows, mode, max_context, logits="all", ple=None) -> (out, state, pending)``: ``x`` int32 ids
    [B, T] (first stage) or the float32 handoff (``[B, T, D]``; qwen4exp ``[B, T, hc, D]``, the residual streams);
    ``mode`` "window" (T <= 8, recurrent state untouched, ``pending`` = list per layer or None) or "prefill" (all
    valid rows committed, ``pending`` None); ``out`` = {"hidden": the handoff, and on the last stage "logits" float32
    [B, T, V] or [B, 1, V] (``logits="last"``) and "mtp_hidden" (what the MTP layer of `strata_jax.layers.mtp`
    consumes: the post-final-norm hidden [B, T, D], or for qwen4exp the final residual streams [B, T, hc, D])}.

    ``ple`` (qwen4exp, only on the stage holding the PLE layer, ``self.has_ple``): the stored table rows of each
    row's n-gram heads, uint8 [B, T, n_heads, row_bytes] as returned by `ple_table(g).gather(prev, tokens)` on the
    host (``prev``: each slot's last ``ngram-1`` committed tokens, EOS-filled at a sequence start; advance it by the
    kept tokens at commit, `PLETable.advance`); they are dequantized on the device. Padding rows may hold any ids.

    ``commit(state, pending, rows, keep)`` advances each segment's slot by ``keep[b]`` rows.

    ``scan=True`` (default): the layers are cut into periods (layer i in period ``i // P``, P the attention
    interval) and runs of identical periods are applied with `jax.lax.scan` over their stacked parameters (one
    compiled period body per run; qwen4exp's PLE period is its own run). State/pending are then
    ``{"runs": [per run: per-layer states stacked on a leading period axis]}``; each step reads its period's
    state slice and writes it back (``dynamic_update_index``). ``scan=False`` keeps ``self.blocks`` (one module per
    layer, state ``{"layers": [...]}``).
    """

    def __init__(self, g, cfg: HybridConfig, start: int, stop: int, device=None, scan: bool = True):
        if not isinstance(cfg, HybridConfig):
            raise UnsupportedError(f"HybridStage needs a HybridConfig, got {type(cfg).__name__} for {cfg.arch!r}")
        self.cfg = cfg
        self.start, self.stop = start, stop
        self.first, self.last = start == 0, stop == cfg.n_layer
        self.hc = cfg.hc
        d = shape_dims(g, cfg)
        self.embed = (Embedding.from_gguf(g, "token_embd.weight", device, shape=(d.vocab_size, d.n_embd))
                      if self.first or (self.last and cfg.tied_head) else None)
        block = HCBlock if cfg.hc else HybridBlock
        blocks = [block(g, cfg, i, device) for i in range(start, stop)]
        self.scan = scan
        if scan:
            P = _period(cfg)
            groups = {}
            for i, b in zip(range(start, stop), blocks):
                groups.setdefault(i // P, []).append(b)
            self.runs = nnx.List(group_runs([Period(v) for _, v in sorted(groups.items())]))
        else:
            self.blocks = nnx.List(blocks)
        self.has_ple = any(start <= i < stop for i in cfg.ple_layers)
        if self.has_ple:
            self.ple_qtype, self.ple_dim = g.info(PLE_TABLE).qtype, int(g.info(PLE_TABLE).shape[-1])
        if self.last:
            if cfg.hc:
                self.out_norm = hyper_read(g, cfg, "output_hc_", device, inject=False)
            else:
                self.out_norm = RMSNorm(load_f32(g, "output_norm.weight", device, shape=(d.n_embd,)), cfg.rms_eps)
            self.head = (self.embed.as_linear() if cfg.tied_head else
                         QLinear.from_gguf(g, "output.weight", device, shape=(d.vocab_size, d.n_embd)))

    def final_norm(self, h, exact: bool = True):
        """The trunk's final norm: RMSNorm, or for qwen4exp the output hyper-connection read [.., hc, D] -> [.., D]."""
        if self.hc:
            return self.out_norm(h, exact)[0]
        return self.out_norm(h)

    @staticmethod
    def ple_table(g, cfg: HybridConfig) -> PLETable:
        """The host-side PLE helper of a qwen4exp file (row ids + gather from the memory map)."""
        return PLETable(g, eos=cfg.ple_eos, mult=cfg.ple_mult, sizes=cfg.ple_sizes, offsets=cfg.ple_offsets,
                        heads_per_ngram=cfg.ple_heads_per_ngram)

    def init_state(self, n_slots: int, max_context: int, kv_dtype=jnp.float32, device=None):
        """Zero state for ``n_slots`` slots (see module docstring)."""
        if self.scan:
            runs = []
            for run in self.runs:
                one = [self._layer_state(b, n_slots, max_context, kv_dtype, None) for b in run.layer.blocks]
                runs.append(jax.tree.map(
                    lambda a, n=run.n: jax.device_put(jnp.zeros((n,) + a.shape, a.dtype), device), one))
            return {"runs": runs}
        return {"layers": [self._layer_state(b, n_slots, max_context, kv_dtype, device) for b in self.blocks]}

    def _layer_state(self, blk, n_slots, max_context, kv_dtype, device):
        cfg = self.cfg
        st = mixer_state(blk.mixer, cfg, n_slots, max_context, kv_dtype, device)
        if cfg.hc:
            st = {"mix": st}
            if blk.ple is not None:
                st["ple"] = jax.device_put(jnp.zeros((n_slots, blk.ple.hist_len, cfg.hc * cfg.n_embd),
                                                     jnp.float32), device)
        return st

    def __call__(self, state, x, rows: Rows, mode: str, max_context: int, logits: str = "all", ple=None):
        if mode not in ("window", "prefill"):
            raise UnsupportedError(f"mode {mode!r} is not 'window' or 'prefill'")
        exact = mode == "window"
        if self.first:
            h = self.embed(x)
            if self.hc:
                h = jnp.broadcast_to(h[:, :, None, :], h.shape[:2] + (self.hc, h.shape[-1]))
        else:
            h = x.astype(jnp.float32)
        ple_emb = dequant_rows(ple, self.ple_qtype, self.ple_dim) if (self.has_ple and ple is not None) else None
        if self.scan:
            sts, pends = [], []
            for run, st_run in zip(self.runs, state["runs"]):
                def body(period, carry, i, _):
                    h, st_run = carry
                    h, new_i, pend_i = period(h, _take(st_run, i), rows, mode, max_context, ple_emb)
                    return (h, _put(st_run, i, new_i)), pend_i

                (h, st_run), pend = run.scan(body, (h, st_run))
                sts.append(st_run)
                pends.append(pend)
            new_state = {"runs": sts}
        else:
            sts, pends = [], []
            for blk, st in zip(self.blocks, state["layers"]):
                h, st, pend = blk(h, st, rows, mode, max_context, ple_emb)
                sts.append(st)
                pends.append(pend)
            new_state = {"layers": sts}
        out = {"hidden": h}
        if self.last:
            out["logits"] = head_logits(self.head, lambda r: self.final_norm(r, exact), h, rows, mode, logits)
            out["mtp_hidden"] = h if self.hc else self.final_norm(h)
        return out, new_state, (pends if mode == "window" else None)

    def commit(self, state, pending, rows: Rows, keep):
        """Advance each segment's slot by exactly ``keep[b]`` rows (int32 [B], 0..T) of the window that returned
        ``pending``; attention layers need nothing (their cells were written by the window)."""
        if pending is None:
            return state
        if self.scan:
            runs = []
            for run, st_run, pend in zip(self.runs, state["runs"], pending):
                def body(period, st_run, i, pend_i):
                    return _put(st_run, i, period.commit(_take(st_run, i), pend_i, rows, keep)), None

                st_run, _ = run.scan(body, st_run, pend)
                runs.append(st_run)
            return {"runs": runs}
        layers = [blk.commit(st, pend, rows, keep) for blk, st, pend in zip(self.blocks, state["layers"], pending)]
        return {"layers": layers}
