"""Mixture-of-experts FFN with a sigmoid-gated shared expert (qwen35moe, qwen3next, qwen4exp).

Sources: HF transformers 5.24 ``Qwen3_5MoeSparseMoeBlock`` / ``Qwen3NextSparseMoeBlock`` (router softmax -> top-k ->
renormalise; shared expert times ``sigmoid(shared_expert_gate(x))``, added).

Per row ``x`` [D] (float32):
  ``p = softmax(W_r x)`` over all E experts; the top k (ties -> lower expert id, `jax.lax.top_k`), renormalised
  ``w = p_k / max(sum p_k, 2^-14)`` (``renorm=False`` keeps ``p_k``); expert e is SwiGLU
  ``down_e(silu(gate_e x) * up_e x)``; ``out = sum_k w_k expert_k(x) + sigmoid(w_sg . x) * shared(x)``.

GGUF tensors (``blk.N.``): ``ffn_gate_inp`` [E, D], ``ffn_{gate,up}_exps`` [E, F, D], ``ffn_down_exps`` [E, D, F]
(numpy order), ``ffn_{gate,up,down}_shexp``, ``ffn_gate_inp_shexp`` [D] (or [1, D]).

The routed experts are `strata_jax.pallas.grouped_experts.moe_experts` (``impl="auto"``): on a GPU the Pallas
kernel, which reads each selected expert's gate/up/down blocks once per window (the union over the window's rows;
windows of more than 8 rows and, on GGUF bytes, prefill chunks in 8-row groups, each group's union once; planar
weights read prefill chunks, any row count, with `moe_prefill`'s grouped GEMM), elsewhere its plain-jnp
reference (each (row, expert) pair dequantized and multiplied alone). The stacked expert tensors stay in their
block format on the device (uint8 [E, rows, row_bytes], or float for F32/F16/BF16). Both paths compute a row the
same way whatever the other rows of the call are (row m of an M-row call == the row alone, bit for bit); the router
softmax and the shared-expert gate's dot are per-row ops (`strata_jax.pallas.rows`: one program per row on the
kernel path; the renormalisation over the k weights in the router's program, or a fixed tree of adds
(`strata_jax.layers.exact`) on the reference path), so a row's arithmetic does not depend on the other rows of
the window, nor on B or T.
"""

from __future__ import annotations

import jax
from flax import nnx

from strata_jax.layers.gdn import qcall
from strata_jax.layers.linear import QLinear, load_f32, load_raw, project_shared
from strata_jax.pallas import rows as row_ops
from strata_jax.pallas.grouped_experts import moe_experts
from strata_jax.pallas.quant_matmul import prepare_weight

RENORM_MIN = 2.0 ** -14


class StackedExperts(nnx.Module):
    """One stacked expert tensor ``[E, n_out, n_in]`` (the expected ``shape``) kept as stored (block bytes or
    float)."""

    def __init__(self, g, name: str, device=None, *, shape):
        w, qtype, shape = load_raw(g, name, device, shape=shape)
        self.w = nnx.Param(prepare_weight(w, qtype, int(shape[-1])))  # the device form (planar under the switch)
        self.qtype = qtype
        self.E, self.n_out, self.n_in = (int(s) for s in shape)


class MoE(nnx.Module):
    """Routed experts + gated shared expert (see module docstring).

    Args: g; prefix ``"blk.N."``; dim: D; n_expert: E; expert_ff / shared_ff: the expert and shared-expert widths
    (None: as the file's ``ffn_gate_exps`` / ``ffn_gate_shexp``; the expected shapes of the module docstring);
    n_used: k; renorm: renormalise the top-k weights.
    """

    def __init__(self, g, prefix: str, *, dim: int, n_expert: int, expert_ff: int | None, shared_ff: int | None,
                 n_used: int, renorm: bool = True, device=None):
        p = prefix
        self.n_used = int(n_used)
        self.renorm = renorm
        self.router = QLinear.from_gguf(g, p + "ffn_gate_inp.weight", device, shape=(n_expert, dim))
        self.gate_exps = StackedExperts(g, p + "ffn_gate_exps.weight", device, shape=(n_expert, expert_ff, dim))
        F = expert_ff or self.gate_exps.n_out
        self.up_exps = StackedExperts(g, p + "ffn_up_exps.weight", device, shape=(n_expert, F, dim))
        self.down_exps = StackedExperts(g, p + "ffn_down_exps.weight", device, shape=(n_expert, dim, F))
        self.has_shared = g.has(p + "ffn_gate_shexp.weight")
        if self.has_shared:
            self.sh_gate = QLinear.from_gguf(g, p + "ffn_gate_shexp.weight", device, shape=(shared_ff, dim))
            Fs = shared_ff or self.sh_gate.n_out
            self.sh_up = QLinear.from_gguf(g, p + "ffn_up_shexp.weight", device, shape=(Fs, dim))
            self.sh_down = QLinear.from_gguf(g, p + "ffn_down_shexp.weight", device, shape=(dim, Fs))
            self.sh_w = nnx.Param(load_f32(g, p + "ffn_gate_inp_shexp.weight", device, shape=(dim,)))

    def route(self, logits: jax.Array):
        """logits float32 [..., E] -> (weights float32 [..., k], ids int32 [..., k])."""
        # top_k(softmax(logits)) and the renormalisation: one launch on a GPU
        return row_ops.softmax_top_k(logits, self.n_used, renorm_min=RENORM_MIN if self.renorm else None)

    def routed(self, x: jax.Array, w: jax.Array, ids: jax.Array, impl: str = "auto",
               prefill: bool = False) -> jax.Array:
        """The routed experts of rows x float32 [N, D] with weights / ids [N, k] -> float32 [N, D] (`moe_experts`;
        ``prefill``: a prefill chunk, which planar weights serve with the grouped GEMM)."""
        qtypes = (self.gate_exps.qtype, self.up_exps.qtype, self.down_exps.qtype)
        return moe_experts(x, ids, w, self.gate_exps.w[...], self.up_exps.w[...], self.down_exps.w[...], qtypes,
                           impl=impl, prefill=prefill)

    def __call__(self, x: jax.Array, exact_rows: bool) -> jax.Array:
        """x float32 [B, T, D] -> float32 [B, T, D]."""
        B, T, D = x.shape
        logits = qcall(self.router, x, exact_rows)
        w, ids = self.route(logits)
        # all B*T rows in one call: row-exact on both paths, and the kernel reads each expert once per 8-row group
        y = self.routed(x.reshape(B * T, D), w.reshape(B * T, -1), ids.reshape(B * T, -1),
                        prefill=not exact_rows).reshape(B, T, D)
        if self.has_shared:
            sg, su = project_shared(x, (self.sh_gate, self.sh_up), exact_rows)
            hs = jax.nn.silu(sg) * su
            s = qcall(self.sh_down, hs, exact_rows)
            # window rows: the product, the sum and the sigmoid in one row program (one launch on a GPU)
            gate = (row_ops.row_sum(x, w=self.sh_w[...], fn=jax.nn.sigmoid) if exact_rows
                    else jax.nn.sigmoid(row_ops.row_sum(x, w=self.sh_w[...])))
            y = y + gate * s
        return y
