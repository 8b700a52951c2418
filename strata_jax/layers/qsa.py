"""Gated full attention of the hybrid families (every ``full_attention_interval``-th layer).

Sources: HF transformers 5.24 ``Qwen3NextAttention`` / ``Qwen3_5MoeAttention`` (q_proj emits per head ``[q | gate]``,
q/k per-head RMSNorm, partial NeoX RoPE, output times ``sigmoid(gate)`` before o_proj), spec MODEL.md B§1.3, A§1.4.

Per token ``x`` [D]: ``qg = W_q x`` reshaped [H, 2*hd] -> q = first hd, gate = last hd (contiguous halves);
``k = W_k x``, ``v = W_v x`` [Hkv, hd]; q, k RMS-normed per head (GGUF weights carry the +1); RoPE (NeoX, first
``rope_dim`` dims); softmax attention over the slot's cells (GQA: head h reads KV head ``h // (H/Hkv)``), scale
``1/sqrt(hd)``; ``out = W_o (attn * sigmoid(gate))``.

K/V cells are written in both window and prefill modes (`strata_jax.state.write_cells`); window rows attend one at
a time (`attend_window`), so a row's result does not depend on the other rows.

qwen4exp's QSA adds a block indexer that selects at most ``budget`` cells; with the tiny fixtures' contexts below the
budget every cell is selected, so the dense path here is exact there (MODEL.md A§1.4: "With 512 or fewer complete
blocks every cell is attended"). The indexer itself is not implemented yet (`GatedAttention.indexer_budget` guards
it: a call whose context could exceed the budget raises).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.errors import UnsupportedError
from strata_jax.layers.attention import attend_prefill, attend_window
from strata_jax.layers.gdn import qcall
from strata_jax.layers.linear import QLinear, load_f32
from strata_jax.layers.norms import RMSNorm
from strata_jax.layers.rope import apply_rope
from strata_jax.state import Rows, write_cells


class GatedAttention(nnx.Module):
    """See module docstring. State per layer: (k_cache, v_cache) [n_slots, max_context + 1, Hkv, hd]."""

    def __init__(self, g, prefix: str, *, n_head: int, n_head_kv: int, head_dim: int, rope_dim: int,
                 rope_theta: float, rms_eps: float, indexer_cells: int = 0, device=None):
        p = prefix
        self.H, self.Hkv, self.hd = n_head, n_head_kv, head_dim
        self.rope_dim, self.theta = rope_dim, rope_theta
        self.indexer_cells = indexer_cells  # >0: QSA layer whose dense path is exact only up to this many cells
        self.wq = QLinear.from_gguf(g, p + "attn_q.weight", device)
        self.wk = QLinear.from_gguf(g, p + "attn_k.weight", device)
        self.wv = QLinear.from_gguf(g, p + "attn_v.weight", device)
        self.wo = QLinear.from_gguf(g, p + "attn_output.weight", device)
        self.q_norm = RMSNorm(load_f32(g, p + "attn_q_norm.weight", device), rms_eps)
        self.k_norm = RMSNorm(load_f32(g, p + "attn_k_norm.weight", device), rms_eps)

    def __call__(self, x, kv, rows: Rows, mode: str, max_context: int):
        """x float32 [B, T, D]; kv (k_cache, v_cache). Returns (out float32 [B, T, D], new kv)."""
        if self.indexer_cells and max_context > self.indexer_cells:
            raise UnsupportedError(f"QSA indexer selection is not implemented: max_context {max_context} exceeds the "
                                   f"{self.indexer_cells} cells the indexer always selects in full")
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
        kc, vc = kv
        kc = write_cells(kc, rows, k, max_context)
        vc = write_cells(vc, rows, v, max_context)
        attend = attend_window if exact else attend_prefill
        o = attend(q, kc, vc, rows, scale=self.hd ** -0.5, max_context=max_context)
        o = (o * jax.nn.sigmoid(gate)).reshape(B, T, self.H * self.hd)
        return qcall(self.wo, o, exact), (kc, vc)
