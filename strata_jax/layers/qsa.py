"""Gated full attention of the hybrid families (every ``full_attention_interval``-th layer).

Sources: HF transformers 5.24 ``Qwen3NextAttention`` / ``Qwen3_5MoeAttention`` (q_proj emits per head ``[q | gate]``,
q/k per-head RMSNorm, partial NeoX RoPE, output times ``sigmoid(gate)`` before o_proj).

Per token ``x`` [D]: ``qg = W_q x`` reshaped [H, 2*hd] -> q = first hd, gate = last hd (contiguous halves);
``k = W_k x``, ``v = W_v x`` [Hkv, hd]; q, k RMS-normed per head (GGUF weights carry the +1); RoPE (NeoX, first
``rope_dim`` dims); softmax attention over the slot's cells (GQA: head h reads KV head ``h // (H/Hkv)``), scale
``1/sqrt(hd)``; ``out = W_o (attn * sigmoid(gate))``.

K/V cells are written in both window and prefill modes (`strata_jax.state.write_cells`). Without an indexer
(qwen35moe, qwen3next) the rows attend every causal cell (`strata_jax.layers.attention`: the split-KV kernel over
each row's listed cells on the kernel path, one row at a time in plain jnp on the reference path), so a row's result
does not depend on the other rows.

qwen4exp's QSA adds a block indexer (`QSAIndexer`, HF ``Qwen4ExpTextQSAIndexer``) that restricts each
query to the top ``budget / ratio`` complete blocks of ``ratio`` cells plus its unfinished tail:
  * raw indexer key per cell ``k_raw = W_ik x`` [dI] (no norm, no RoPE), stored in a third per-slot cell cache
    [n_slots, max_context + 1, dI], written in window and prefill modes exactly like K/V (a rejected row's cell is
    overwritten by the next window that reaches that position, before any query can read it);
  * pooled key of block b (cells ``b*ratio .. b*ratio+ratio-1``): ``RoPE(RMSNorm_k(mean of the raw keys))`` rotated
    at position ``b*ratio`` (the block's first cell), recomputed from the raw cache for every call;
  * indexer query: ``W_iq x`` [nI, dI], per-head RMSNorm, RoPE at the row's position;
  * block score ``sum_h ReLU(q_h . pooled_b)`` (HF divides by ``sqrt(dI)``: the same ranking); a query at position
    p sees the ``(p+1) // ratio`` complete blocks (block-causal in prefill: per query row), takes the top ``n_top``
    of them (ties to the lower block index, `jax.lax.top_k`) and always its tail ``nb*ratio .. p``. With
    ``nb <= n_top`` every cell is attended.
The selection only masks cells of the ordinary causal softmax attention (HF fills unselected cells with the dtype's
minimum before the softmax), so the attention runs over the selected cells only: selection and attention are
`strata_jax.pallas.qsa.qsa_attention` in a window (``impl="auto"``: the Pallas flash-decoding kernel over the
selected cells on a GPU, its plain-jnp reference elsewhere) and `strata_jax.pallas.qsa.qsa_prefill` in prefill
mode (the kernel path: by default the window's kernel over the chunk's rows, or with ``STRATA_QSA_PREFILL=tiles``
tiled indexer scores and a block-sparse flash-attention kernel on tensor cores; the reference path: the same
reference as a window's), each called once for all B*T rows (each row reads its own slot's part of the flat
caches). Both paths compute every row alone (the row does not depend on the other rows, T or B), in window and
prefill mode alike; on the kernel path a prefill row and a window row at the same position need not agree bit for
bit (other split layouts or kernels, each within ~1e-5 of float64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.layers.attention import attend_prefill, attend_window
from strata_jax.layers.exact import row_sum
from strata_jax.layers.gdn import qcall
from strata_jax.layers.linear import QLinear, load_f32, project_shared
from strata_jax.layers.norms import RMSNorm
from strata_jax.layers.rope import apply_rope
from strata_jax.pallas.qsa import qsa_attention, qsa_prefill
from strata_jax.pallas.qsa.reference import select
from strata_jax.state import Rows, write_cells


class QSAIndexer(nnx.Module):
    """The QSA block indexer (see module docstring).

    Args: g; prefix ``"blk.N."`` (tensors ``indexer.{q_proj,k_proj,q_norm,k_norm}.weight``: [nI*dI, D], [dI, D],
    [dI], [dI]); dim: D; n_heads: nI; head_dim: dI; ratio (cells per block, GGUF ``attention.compress_ratios[N]``);
    budget (cells, GGUF ``attention.indexer.top_k``); rope_dim / rope_theta (as the attention's); rms_eps.
    """

    def __init__(self, g, prefix: str, *, dim: int, n_heads: int, head_dim: int, ratio: int, budget: int,
                 rope_dim: int, rope_theta: float, rms_eps: float, device=None):
        p = prefix + "indexer."
        self.nh, self.hd, self.ratio = int(n_heads), int(head_dim), int(ratio)
        self.n_top = max(1, int(budget) // self.ratio)
        self.rope_dim, self.theta = rope_dim, rope_theta
        self.wq = QLinear.from_gguf(g, p + "q_proj.weight", device, shape=(n_heads * head_dim, dim))
        self.wk = QLinear.from_gguf(g, p + "k_proj.weight", device, shape=(head_dim, dim))
        self.q_norm = RMSNorm(load_f32(g, p + "q_norm.weight", device, shape=(head_dim,)), rms_eps)
        self.k_norm = RMSNorm(load_f32(g, p + "k_norm.weight", device, shape=(head_dim,)), rms_eps)

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

    def row_limits(self, pos: jax.Array, max_context: int):
        """(n_kv, n_complete), int32 like ``pos``: the cells 0..n_kv-1 a query at ``pos`` sees (``pos + 1``, clipped
        to [1, max_context] for padding rows past the context) and its complete blocks ``n_kv // ratio``."""
        n_kv = jnp.clip(pos + 1, 1, max_context)
        return n_kv, n_kv // self.ratio

    def cell_mask(self, q: jax.Array, pooled: jax.Array, pos: jax.Array, n_cells: int) -> jax.Array:
        """The cells each query attends, as a dense mask (the selection `GatedAttention` uses, for tests).

        Args: q [B, t, nI, dI]; pooled [B, NB, dI]; pos int32 [B, t]; n_cells: cache cells (max_context + 1).
        Returns: bool [B, t, n_cells] (the causal limit ``cell <= pos`` is included).
        """
        B, t = pos.shape
        n_kv, n_complete = self.row_limits(pos, n_cells - 1)
        seg = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, t)).reshape(-1)
        cells = select(q.reshape(B * t, self.nh, self.hd), pooled, n_kv.reshape(-1), n_complete.reshape(-1),
                       top_blocks=self.n_top, block=self.ratio, seg=seg)
        cells = jnp.where(cells >= 0, cells, n_cells)  # dropped below
        mask = jnp.zeros((B * t, n_cells), bool).at[jnp.arange(B * t)[:, None], cells].set(True, mode="drop")
        return mask.reshape(B, t, n_cells)


class GatedAttention(nnx.Module):
    """See module docstring. State per layer: (k_cache, v_cache) [n_slots, max_context + 1, Hkv, hd], plus the raw
    indexer-key cache [n_slots, max_context + 1, dI] as a third entry when the layer has an indexer.

    Tensors (``blk.N.``, expected at ``dim`` = D and the head counts / width, ints or `strata_jax.config.Dim` s):
    ``attn_q`` [H*2*hd, D], ``attn_k`` / ``attn_v`` [Hkv*hd, D], ``attn_output`` [D, H*hd], ``attn_{q,k}_norm``
    [hd]; the indexer's (`QSAIndexer`) when ``indexer`` is given."""

    def __init__(self, g, prefix: str, *, dim: int, n_head: int, n_head_kv: int, head_dim: int, rope_dim: int,
                 rope_theta: float, rms_eps: float, indexer: dict | None = None, device=None):
        p = prefix
        self.H, self.Hkv, self.hd = int(n_head), int(n_head_kv), int(head_dim)
        self.rope_dim, self.theta = rope_dim, rope_theta
        self.indexer = (QSAIndexer(g, p, dim=dim, rope_dim=rope_dim, rope_theta=rope_theta, rms_eps=rms_eps,
                                   device=device, **indexer) if indexer else None)
        self.wq = QLinear.from_gguf(g, p + "attn_q.weight", device, shape=(2 * n_head * head_dim, dim))
        self.wk = QLinear.from_gguf(g, p + "attn_k.weight", device, shape=(n_head_kv * head_dim, dim))
        self.wv = QLinear.from_gguf(g, p + "attn_v.weight", device, shape=(n_head_kv * head_dim, dim))
        self.wo = QLinear.from_gguf(g, p + "attn_output.weight", device, shape=(dim, n_head * head_dim))
        self.q_norm = RMSNorm(load_f32(g, p + "attn_q_norm.weight", device, shape=(head_dim,)), rms_eps)
        self.k_norm = RMSNorm(load_f32(g, p + "attn_k_norm.weight", device, shape=(head_dim,)), rms_eps)

    def __call__(self, x, kv, rows: Rows, mode: str, max_context: int):
        """x float32 [B, T, D]; kv (k_cache, v_cache[, indexer_cache]). Returns (out float32 [B, T, D], new kv)."""
        B, T, _ = x.shape
        exact = mode == "window"
        qg, k, v = project_shared(x, (self.wq, self.wk, self.wv), exact)
        qg = qg.reshape(B, T, self.H, 2 * self.hd)
        q, gate = qg[..., :self.hd], qg[..., self.hd:]
        k = k.reshape(B, T, self.Hkv, self.hd)
        v = v.reshape(B, T, self.Hkv, self.hd)
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
            o = self._attend_indexed(q, iq, kc, vc, ic, rows, pos, max_context, mode == "prefill")
        o = (o * jax.nn.sigmoid(gate)).reshape(B, T, self.H * self.hd)
        return qcall(self.wo, o, exact), new_kv

    def _attend_indexed(self, q, iq, kc, vc, ic, rows: Rows, pos, max_context: int, prefill: bool):
        """QSA attention of all B*T rows in one call (`qsa_prefill` for a prefill chunk's segments, else
        `qsa_attention` over the rows); q [B, T, H, hd], iq [B, T, nI, dI]."""
        B, T = q.shape[:2]
        idx = self.indexer
        pooled = idx.pooled(ic[rows.slot], max_context)  # [B, NB, dI]
        n_kv, n_complete = idx.row_limits(pos, max_context)
        per_slot = kc.shape[1]  # the flat caches [n_slots * (max_context + 1), Hkv, hd] (a free reshape)
        flat = lambda c: c.reshape(-1, *c.shape[2:])
        if prefill:
            return qsa_prefill(q, flat(kc), flat(vc), iq, pooled, n_kv, n_complete, top_blocks=idx.n_top,
                               block=idx.ratio, scale=self.hd ** -0.5, cell_base=rows.slot * per_slot,
                               impl="auto")
        seg = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
        base = jnp.broadcast_to((rows.slot * per_slot)[:, None], (B, T))
        rows_of = lambda a: a.reshape(B * T, *a.shape[2:])
        o = qsa_attention(rows_of(q), flat(kc), flat(vc), rows_of(iq),
                          pooled, rows_of(n_kv), rows_of(n_complete), top_blocks=idx.n_top, block=idx.ratio,
                          scale=self.hd ** -0.5, seg=rows_of(seg), cell_base=rows_of(base), impl="auto")
        return o.reshape(q.shape)
