"""Gated full attention of the hybrid families (every ``full_attention_interval``-th layer).

Sources: HF transformers 5.24 ``Qwen3NextAttention`` / ``Qwen3_5MoeAttention`` (q_proj emits per head ``[q | gate]``,
q/k per-head RMSNorm, partial NeoX RoPE, output times ``sigmoid(gate)`` before o_proj), spec MODEL.md B§1.3, A§1.4.

Per token ``x`` [D]: ``qg = W_q x`` reshaped [H, 2*hd] -> q = first hd, gate = last hd (contiguous halves);
``k = W_k x``, ``v = W_v x`` [Hkv, hd]; q, k RMS-normed per head (GGUF weights carry the +1); RoPE (NeoX, first
``rope_dim`` dims); softmax attention over the slot's cells (GQA: head h reads KV head ``h // (H/Hkv)``), scale
``1/sqrt(hd)``; ``out = W_o (attn * sigmoid(gate))``.

K/V cells are written in both window and prefill modes (`strata_jax.state.write_cells`); window rows attend one at
a time (`attend_window`), so a row's result does not depend on the other rows.

qwen4exp's QSA adds a block indexer (`QSAIndexer`, HF ``Qwen4ExpTextQSAIndexer``, MODEL.md A§1.4) that restricts each
query to the top ``budget / ratio`` complete blocks of ``ratio`` cells plus its unfinished tail:
  * raw indexer key per cell ``k_raw = W_ik x`` [dI] (no norm, no RoPE), stored in a third per-slot cell cache
    [n_slots, max_context + 1, dI], written in window and prefill modes exactly like K/V (a rejected row's cell is
    overwritten by the next window that reaches that position, before any query can read it);
  * pooled key of block b (cells ``b*ratio .. b*ratio+ratio-1``): ``RoPE(RMSNorm_k(mean of the raw keys))`` rotated
    at position ``b*ratio`` (the block's first cell), recomputed from the raw cache for every call;
  * indexer query: ``W_iq x`` [nI, dI], per-head RMSNorm, RoPE at the row's position;
  * block score ``sum_h ReLU(q_h . pooled_b) / sqrt(dI)``; a query at position p sees the ``(p+1) // ratio``
    complete blocks (block-causal in prefill: per query row), takes the top ``n_top`` of them (ties to the lower
    block index, `jax.lax.top_k`) and always its tail ``nb*ratio .. p``. With ``nb <= n_top`` every cell is
    attended.
The selection only masks cells of the ordinary causal softmax attention (HF fills unselected cells with the dtype's
minimum before the softmax). In window mode each row is computed alone (``lax.map``), selection included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.layers.attention import attend_prefill, attend_window
from strata_jax.layers.exact import row_sum, softmax
from strata_jax.layers.gdn import qcall
from strata_jax.layers.linear import QLinear, load_f32
from strata_jax.layers.norms import RMSNorm
from strata_jax.layers.rope import apply_rope
from strata_jax.state import Rows, write_cells


_NEG = -1e30


class QSAIndexer(nnx.Module):
    """The QSA block indexer (see module docstring).

    Args: g; prefix ``"blk.N."`` (tensors ``indexer.{q_proj,k_proj,q_norm,k_norm}.weight``); n_heads; head_dim;
    ratio (cells per block, GGUF ``attention.compress_ratios[N]``); budget (cells, GGUF ``attention.indexer.top_k``);
    rope_dim / rope_theta (as the attention's); rms_eps.
    """

    def __init__(self, g, prefix: str, *, n_heads: int, head_dim: int, ratio: int, budget: int, rope_dim: int,
                 rope_theta: float, rms_eps: float, device=None):
        p = prefix + "indexer."
        self.nh, self.hd, self.ratio = n_heads, head_dim, int(ratio)
        self.n_top = max(1, int(budget) // self.ratio)
        self.rope_dim, self.theta = rope_dim, rope_theta
        self.wq = QLinear.from_gguf(g, p + "q_proj.weight", device)
        self.wk = QLinear.from_gguf(g, p + "k_proj.weight", device)
        self.q_norm = RMSNorm(load_f32(g, p + "q_norm.weight", device), rms_eps)
        self.k_norm = RMSNorm(load_f32(g, p + "k_norm.weight", device), rms_eps)

    def project(self, x, pos, exact: bool):
        """x [B, T, D], pos int32 [B, T] -> (query [B, T, nI, dI] normed + rotated, raw key [B, T, dI])."""
        B, T, _ = x.shape
        q = self.q_norm(qcall(self.wq, x, exact).reshape(B, T, self.nh, self.hd))
        q = apply_rope(q, pos, self.rope_dim, self.theta, True)
        return q, qcall(self.wk, x, exact)

    def pooled(self, raw: jax.Array, max_context: int) -> jax.Array:
        """raw keys of the segments' slots [B, S1, dI] -> pooled, normed, rotated block keys [B, NB, dI],
        NB = max_context // ratio (each block's arithmetic is elementwise + one row norm: row exact)."""
        B = raw.shape[0]
        NB = max_context // self.ratio
        grp = raw[:, :NB * self.ratio].astype(jnp.float32).reshape(B, NB, self.ratio, self.hd)
        mean = row_sum(jnp.swapaxes(grp, -1, -2))[..., 0] / self.ratio
        pk = self.k_norm(mean)
        starts = jnp.broadcast_to(jnp.arange(NB, dtype=jnp.int32) * self.ratio, (B, NB))
        return apply_rope(pk[:, :, None, :], starts, self.rope_dim, self.theta, True)[:, :, 0]

    def cell_mask(self, q: jax.Array, pooled: jax.Array, pos: jax.Array, n_cells: int) -> jax.Array:
        """Selected cells of each query.

        Args: q [B, t, nI, dI]; pooled [B, NB, dI]; pos int32 [B, t]; n_cells: cache cells (max_context + 1).
        Returns: bool [B, t, n_cells] (the causal limit ``cell <= pos`` is included).
        """
        NB = pooled.shape[1]
        s = jnp.einsum("bthd,bnd->btnh", q, pooled, precision=jax.lax.Precision.HIGHEST)
        s = row_sum(jax.nn.relu(s))[..., 0] / (self.hd ** 0.5)  # [B, t, NB]
        nb = (pos + 1) // self.ratio
        blk = jnp.arange(NB, dtype=jnp.int32)
        complete = blk[None, None, :] < nb[..., None]
        s = jnp.where(complete, s, -1.0)  # scores are >= 0: incomplete blocks rank last
        _, top = jax.lax.top_k(s, min(self.n_top, NB))  # ties -> lower block index
        sel = jnp.any(blk[None, None, None, :] == top[..., None], axis=-2) & complete  # [B, t, NB]
        cells = jnp.arange(n_cells, dtype=jnp.int32)
        cblk = jnp.minimum(cells // self.ratio, NB - 1)
        in_sel = jnp.take(sel, cblk, axis=-1) & (cells[None, None, :] < (nb * self.ratio)[..., None])
        tail = (cells[None, None, :] >= (nb * self.ratio)[..., None]) & (cells[None, None, :] <= pos[..., None])
        return in_sel | tail


def _attend_rows(q, K, V, allowed, scale):
    """q [B, t, Hq, D], K/V [B, S1, Hkv, D], allowed bool [B, t, S1] -> [B, t, Hq, D] (exact softmax)."""
    B, t, Hq, D = q.shape
    Hkv = K.shape[2]
    g = Hq // Hkv
    qg = q.reshape(B, t, Hkv, g, D)
    s = jnp.einsum("btkgd,bskd->btkgs", qg, K) * scale
    s = jnp.where(allowed[:, :, None, None, :], s, _NEG)
    o = jnp.einsum("btkgs,bskd->btkgd", softmax(s), V)
    return o.reshape(B, t, Hq, D)


class GatedAttention(nnx.Module):
    """See module docstring. State per layer: (k_cache, v_cache) [n_slots, max_context + 1, Hkv, hd], plus the raw
    indexer-key cache [n_slots, max_context + 1, dI] as a third entry when the layer has an indexer."""

    def __init__(self, g, prefix: str, *, n_head: int, n_head_kv: int, head_dim: int, rope_dim: int,
                 rope_theta: float, rms_eps: float, indexer: dict | None = None, device=None):
        p = prefix
        self.H, self.Hkv, self.hd = n_head, n_head_kv, head_dim
        self.rope_dim, self.theta = rope_dim, rope_theta
        self.indexer = (QSAIndexer(g, p, rope_dim=rope_dim, rope_theta=rope_theta, rms_eps=rms_eps, device=device,
                                   **indexer) if indexer else None)
        self.wq = QLinear.from_gguf(g, p + "attn_q.weight", device)
        self.wk = QLinear.from_gguf(g, p + "attn_k.weight", device)
        self.wv = QLinear.from_gguf(g, p + "attn_v.weight", device)
        self.wo = QLinear.from_gguf(g, p + "attn_output.weight", device)
        self.q_norm = RMSNorm(load_f32(g, p + "attn_q_norm.weight", device), rms_eps)
        self.k_norm = RMSNorm(load_f32(g, p + "attn_k_norm.weight", device), rms_eps)

    def __call__(self, x, kv, rows: Rows, mode: str, max_context: int):
        """x float32 [B, T, D]; kv (k_cache, v_cache[, indexer_cache]). Returns (out float32 [B, T, D], new kv)."""
        B, T, _ = x.shape
        exact = mode == "window"
        qg = qcall(self.wq, x, exact).reshape(B, T, self.H, 2 * self.hd)
        q, gate = qg[..., :self.hd], qg[..., self.hd:]
        k = qcall(self.wk, x, exact).reshape(B, T, self.Hkv, self.hd)
        v = qcall(self.wv, x, exact).reshape(B, T, self.Hkv, self.hd)
        q, k = self.q_norm(q), self.k_norm(k)
        pos = rows.positions(T)
        q = apply_rope(q, pos, self.rope_dim, self.theta, True)
        k = apply_rope(k, pos, self.rope_dim, self.theta, True)
        kc, vc = kv[0], kv[1]
        kc = write_cells(kc, rows, k, max_context)
        vc = write_cells(vc, rows, v, max_context)
        if self.indexer is None:
            attend = attend_window if exact else attend_prefill
            o = attend(q, kc, vc, rows, scale=self.hd ** -0.5, max_context=max_context)
            new_kv = (kc, vc)
        else:
            iq, ik = self.indexer.project(x, pos, exact)
            ic = write_cells(kv[2], rows, ik, max_context)
            new_kv = (kc, vc, ic)
            o = self._attend_indexed(q, iq, kc, vc, ic, rows, pos, max_context, exact)
        o = (o * jax.nn.sigmoid(gate)).reshape(B, T, self.H * self.hd)
        return qcall(self.wo, o, exact), new_kv

    def _attend_indexed(self, q, iq, kc, vc, ic, rows: Rows, pos, max_context: int, exact: bool):
        """Softmax attention restricted to the indexer's selection; q [B, T, H, hd], iq [B, T, nI, dI]."""
        K = kc[rows.slot].astype(jnp.float32)
        V = vc[rows.slot].astype(jnp.float32)
        pooled = self.indexer.pooled(ic[rows.slot], max_context)
        n_cells = K.shape[1]
        cells = jnp.arange(n_cells, dtype=jnp.int32)
        scale = self.hd ** -0.5

        def rows_out(qr, iqr, pr):  # [B, t, ...] -> [B, t, H, hd]
            allowed = self.indexer.cell_mask(iqr, pooled, pr, n_cells) & (cells < max_context)
            return _attend_rows(qr, K, V, allowed, scale)

        if not exact:
            return rows_out(q, iq, pos)
        T = q.shape[1]
        out = jax.lax.map(lambda t: rows_out(q[:, t][:, None], iq[:, t][:, None], pos[:, t][:, None])[:, 0],
                          jnp.arange(T))  # [T, B, H, hd]
        return jnp.transpose(out, (1, 0, 2, 3))
