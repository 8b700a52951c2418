"""Gated DeltaNet (GDN) linear-attention mixer of the hybrid families (qwen35moe, qwen3next, qwen4exp).

Sources: HF transformers 5.24 ``modeling_qwen3_next.Qwen3NextGatedDeltaNet`` and
``modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet`` (the numerics), llama.cpp's converter ``conversion/qwen.py``
(GGUF layout); windows leave the state untouched, the commit advances it.

Per token ``x`` [D] (all float32):
  1. ``qkv = W_qkv x`` [C], C = 2*Hk*Dk + Hv*Dv; causal depthwise conv (kernel K, no bias) over time with the slot's
     last K-1 inputs as history; SiLU over all C channels; split into q [Hk,Dk] | k [Hk,Dk] | v [Hv,Dv].
  2. q, k l2-normalised per head (``x * rsqrt(sum(x^2) + 1e-6)``), q scaled by Dk**-0.5.
  3. ``beta = sigmoid(W_b x)``, ``g = softplus(W_a x + dt_bias) * ssm_a`` (``ssm_a = -exp(A_log)`` as stored).
  4. Gated delta rule per v-head (`strata_jax.pallas.gdn`): v-head j reads k-head ``j % Hk`` ("tiled", the order of
     qwen35*/qwen4exp GGUFs, whose converter reorders the v heads) or ``j // (Hv/Hk)`` ("grouped", qwen3next GGUFs
     and HF).
  5. ``y = RMSNorm_head(o) * w_norm * act(z)``, ``z = W_z x``; act = SiLU (qwen35*/qwen3next) or sigmoid (qwen4exp).
  6. ``out = W_out y``.

GGUF tensors (``blk.N.``): ``attn_qkv``, ``attn_gate`` (z), ``ssm_beta`` + ``ssm_alpha`` (qwen35*/qwen4exp) or the
fused ``ssm_ba`` (qwen3next: per k-head group ``[b (r values) | a (r values)]``, r = Hv/Hk, grouped v order),
``ssm_a`` [Hv], ``ssm_dt.bias`` [Hv], ``ssm_conv1d`` [C, K], ``ssm_norm`` [Dv] (plain weight), ``ssm_out``.

State per slot: ``S`` float32 [Hv, Dk, Dv] and ``conv`` float32 [K-1, C] (the last K-1 conv *inputs*).
Window mode reads both and writes neither: it returns the per-row k, v, g, beta and conv inputs in ``pending``;
`GatedDeltaNet.commit` replays exactly ``keep[b]`` rows. Prefill mode commits all valid rows at once (rows past
``n_valid`` are neutralised: k = 0, beta = 0, g = 0 leave the state unchanged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.layers.linear import QLinear, load_f32, project_shared
from strata_jax.layers.norms import rms_norm
from strata_jax.pallas import rows as row_ops
from strata_jax.pallas.gdn import gdn_chunked, gdn_commit, gdn_window
from strata_jax.state import Rows

L2_EPS = 1e-6

def qcall(lin: QLinear, x: jax.Array, exact: bool) -> jax.Array:
    """``lin(x)`` with row-exact arithmetic for any row count when ``exact`` (window mode; see `QLinear.__call__`)."""
    return lin(x, exact)


def rowwise(fn, x: jax.Array, exact: bool = True) -> jax.Array:
    """``fn(x)`` for an elementwise ``fn`` (with exp/log inside: sigmoid, softplus) on a narrow last axis, computed
    one row (``x[..., :]``) at a time when ``exact`` (`strata_jax.pallas.rows.row_map`: one Pallas program per row
    on the kernel path, ``lax.map`` over the rows on the reference path).

    XLA CPU evaluates such functions with vector instructions over the fused iteration space and with scalar ones on
    its remainder; when a row holds fewer values than a vector (hc = 4 inject weights, the PLE gates, 6 GDN heads)
    the path a row takes -- and its last bit -- depends on how many rows are computed together (seen: T=1 vs T=4
    windows differ by 1 ulp with AVX, agree with SSE 4.2)."""
    return row_ops.row_map(fn, x) if exact else fn(x)


def gdn_gates(b, a, dt_bias, ssm_a):
    """(``beta = sigmoid(b)``, ``g = softplus(a + dt_bias) * ssm_a``): float32, b / a [..., Hv], dt_bias / ssm_a
    [Hv] (module docstring, step 3); elementwise (`rows.row_map_multi`'s ``fn``)."""
    return jax.nn.sigmoid(b), jax.nn.softplus(a + dt_bias) * ssm_a


def l2norm(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    """``x * rsqrt(sum(x^2, -1) + eps)`` (HF ``l2norm``), float32, row-independent (`strata_jax.pallas.rows`)."""
    return row_ops.rms_norm(x, None, eps, mean=False)


def causal_conv(hist: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
    """Depthwise causal conv over time.

    Args:
      hist: float32 [B, K-1, C], the K-1 inputs before ``x[:, 0]``.
      x: float32 [B, T, C].
      w: float32 [C, K] (GGUF ``ssm_conv1d``; HF ``conv1d.weight[:, 0, :]``).

    Returns:
      float32 [B, T, C]: ``out[t] = sum_i w[:, i] * seq[t + i]`` with ``seq = hist ++ x``.
      Each output row only reads its own and earlier rows, elementwise (row exact).
    """
    K = w.shape[1]
    T = x.shape[1]
    seq = jnp.concatenate([hist, x], axis=1)
    out = seq[:, 0:T] * w[:, 0]
    for i in range(1, K):
        out = out + seq[:, i:i + T] * w[:, i]
    return out


def conv_tail(hist: jax.Array, x: jax.Array, n: jax.Array) -> jax.Array:
    """The K-1 conv inputs after consuming the first ``n[b]`` rows of ``x``: float32 [B, K-1, C].

    Args: hist [B, K-1, C]; x [B, T, C]; n int32 [B] in [0, T].
    """
    Km1 = hist.shape[1]
    seq = jnp.concatenate([hist, x.astype(hist.dtype)], axis=1)  # [B, K-1+T, C]
    idx = n[:, None] + jnp.arange(Km1, dtype=jnp.int32)[None, :]  # rows n .. n+K-2 of seq
    return jnp.take_along_axis(seq, idx[:, :, None], axis=1)


class GatedDeltaNet(nnx.Module):
    """One GDN mixer (see module docstring).

    Args:
      g: an open `GGUFFile`; prefix: ``"blk.N."``; dim: D; n_k_heads/n_v_heads/d_k/d_v/conv_kernel: geometry (ints
        or `strata_jax.config.Dim` s: the tensors' expected shapes, module docstring);
      v_order: ``"tiled"`` or ``"grouped"``; gate_act: ``"silu"`` or ``"sigmoid"``; rms_eps: of the output norm.
    """

    def __init__(self, g, prefix: str, *, dim: int, n_k_heads: int, n_v_heads: int, d_k: int, d_v: int,
                 conv_kernel: int, v_order: str, gate_act: str, rms_eps: float, device=None):
        p = prefix
        C = 2 * n_k_heads * d_k + n_v_heads * d_v  # the expected shapes below: ints or strata_jax.config.Dim s
        inner = n_v_heads * d_v
        self.Hk, self.Hv, self.Dk, self.Dv, self.K = (int(x) for x in (n_k_heads, n_v_heads, d_k, d_v, conv_kernel))
        self.C = int(C)
        self.v_order = v_order
        self.gate_act = gate_act
        self.eps = rms_eps
        # q / k / v feed the delta rule, which amplifies their error: their prefill GEMM keeps bf16x2 (f16 there
        # failed the qwen3next oracle test at 5.9e-2; every other GEMM passes at f16: gemm.DEFAULT_PRECISION)
        self.wqkv = QLinear.from_gguf(g, p + "attn_qkv.weight", device, shape=(C, dim), precise=True)
        self.wz = QLinear.from_gguf(g, p + "attn_gate.weight", device, shape=(inner, dim))
        if g.has(p + "ssm_ba.weight"):
            self.wba = QLinear.from_gguf(g, p + "ssm_ba.weight", device, shape=(2 * n_v_heads, dim))
            self.wb = self.wa = None
        else:
            self.wba = None
            self.wb = QLinear.from_gguf(g, p + "ssm_beta.weight", device, shape=(n_v_heads, dim))
            self.wa = QLinear.from_gguf(g, p + "ssm_alpha.weight", device, shape=(n_v_heads, dim))
        self.ssm_a = nnx.Param(load_f32(g, p + "ssm_a", device, shape=(n_v_heads,)))
        self.dt_bias = nnx.Param(load_f32(g, p + "ssm_dt.bias", device, shape=(n_v_heads,)))
        self.conv_w = nnx.Param(load_f32(g, p + "ssm_conv1d.weight", device, shape=(C, conv_kernel)))
        self.norm_w = nnx.Param(load_f32(g, p + "ssm_norm.weight", device, shape=(d_v,)))
        self.wout = QLinear.from_gguf(g, p + "ssm_out.weight", device, shape=(dim, inner))

    def state_shapes(self):
        """{"S": (Hv, Dk, Dv), "conv": (K-1, C)} per slot, float32."""
        return {"S": (self.Hv, self.Dk, self.Dv), "conv": (self.K - 1, self.C)}

    def _beta_alpha(self, x, exact):
        if self.wba is not None:  # qwen3next: per k-head group [b (r) | a (r)], grouped v order
            B, T = x.shape[:2]
            r = self.Hv // self.Hk
            ba = qcall(self.wba, x, exact).reshape(B, T, self.Hk, 2 * r)
            return ba[..., :r].reshape(B, T, self.Hv), ba[..., r:].reshape(B, T, self.Hv)
        return project_shared(x, (self.wb, self.wa), exact)

    def _to_v_heads(self, a):
        """[B, T, Hk, Dk] -> [B, T, Hv, Dk] in the GGUF's v-head order (`rows.qk_l2_norm` does this for q and k)."""
        r = self.Hv // self.Hk
        if self.v_order == "tiled":
            return jnp.tile(a, (1, 1, r, 1))
        return jnp.repeat(a, r, axis=2)

    def __call__(self, x, st, rows: Rows, mode: str):
        """Args: x float32 [B, T, D]; st this layer's state {"S": [n_slots,Hv,Dk,Dv], "conv": [n_slots,K-1,C]};
        rows; mode "window" (T <= 8) | "prefill".

        Returns: (out float32 [B, T, D], new st, pending) -- pending is None in prefill mode (state already
        advanced by the n_valid rows), else {"qkv" [B,T,C], "k" [B,T,Hv,Dk], "v" [B,T,Hv,Dv], "g", "beta" [B,T,Hv]}.
        """
        B, T, _ = x.shape
        exact = mode == "window"
        qkv = qcall(self.wqkv, x, exact)
        hist = st["conv"][rows.slot]
        c = jax.nn.silu(causal_conv(hist, qkv, self.conv_w[...]))
        nq = self.Hk * self.Dk
        v = c[..., 2 * nq:].reshape(B, T, self.Hv, self.Dv)
        # l2norm(q) * Dk^-0.5 and l2norm(k) of q = c[..., :nq], k = c[..., nq:2nq] (read in place: no slice
        # launches), each repeated to the v heads (_to_v_heads' order): one launch
        q, k = row_ops.qk_l2_norm_packed(c, L2_EPS, h=self.Hk, n=self.Dk, q_scale=self.Dk ** -0.5, heads=self.Hv,
                                         order=self.v_order)
        b, a = self._beta_alpha(x, exact)
        if exact:  # window rows: both gates in one row program (one launch on a GPU; the bits of two row maps)
            beta, gdec = row_ops.row_map_multi(gdn_gates, (b, a), (self.dt_bias[...], self.ssm_a[...]), n_out=2)
        else:
            beta, gdec = gdn_gates(b, a, self.dt_bias[...], self.ssm_a[...])
        if mode == "window":
            o = gdn_window(st["S"], q, k, v, gdec, beta, slots=rows.slot, impl="auto")
            pending = {"qkv": qkv, "k": k, "v": v, "g": gdec, "beta": beta}
            new_st = st
        else:
            ok = rows.valid(T)[:, :, None]
            k_m = jnp.where(ok[..., None], k, 0.0)
            o, S = gdn_chunked(st["S"], q, k_m, v, jnp.where(ok, gdec, 0.0), jnp.where(ok, beta, 0.0),
                               slots=rows.slot, impl="auto")
            tail = conv_tail(hist, qkv, rows.n_valid)
            new_st = {"S": S, "conv": st["conv"].at[rows.slot].set(tail)}
            pending = None
        z = qcall(self.wz, x, exact).reshape(B, T, self.Hv, self.Dv)
        on = rms_norm(o, self.norm_w[...], self.eps)
        act = jax.nn.sigmoid if self.gate_act == "sigmoid" else jax.nn.silu
        y = (on * act(z)).reshape(B, T, self.Hv * self.Dv)
        return qcall(self.wout, y, exact), new_st, pending

    def commit(self, st, pending, rows: Rows, keep):
        """Advance each segment's slot by exactly ``keep[b]`` (0..T) rows of the window that made ``pending``.

        Args: st {"S", "conv"}; pending from a window call; rows: that window's layout; keep int32 [B].
        Returns: the new st.
        """
        keep = jnp.asarray(keep, jnp.int32)
        S = gdn_commit(st["S"], pending["k"], pending["v"], pending["g"], pending["beta"], keep, slots=rows.slot,
                       impl="auto")
        tail = conv_tail(st["conv"][rows.slot], pending["qkv"], keep)
        return {"S": S, "conv": st["conv"].at[rows.slot].set(tail)}
