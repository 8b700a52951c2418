"""The feed-forward half of a block: a gated MLP (SwiGLU / GeGLU), or the mixture of experts of `strata_jax.layers.moe`.

Sources: HF transformers ``LlamaMLP`` / ``Qwen3MLP`` / ``Qwen3_5MLP`` (SwiGLU), ``Gemma3MLP`` (GeGLU with tanh-GELU);
llama.cpp ``build_ffn(..., LLM_FFN_SILU | LLM_FFN_GELU, LLM_FFN_PAR)``.

``y = down(act(gate x) * up x)`` with GGUF tensors ``blk.N.ffn_{gate,up,down}`` (numpy [F, D], [F, D], [D, F]);
act = SiLU (``mlp_act="silu"``) or tanh-approximated GELU (``"gelu_tanh"``). Every matmul is row-exact in windows
(`strata_jax.layers.linear.QLinear`), and the activation is elementwise, so a row's result does not depend on the
other rows.
"""

from __future__ import annotations

import jax
from flax import nnx

from strata_jax.config import shape_dims
from strata_jax.layers.linear import QLinear, project_shared
from strata_jax.layers.moe import MoE

MLP_ACTS = ("silu", "gelu_tanh")


def mlp_act(name: str):
    """The gate activation of a gated MLP: ``silu`` or ``gelu_tanh``."""
    return jax.nn.silu if name == "silu" else (lambda x: jax.nn.gelu(x, approximate=True))


class GatedMLP(nnx.Module):
    """``down(act(gate x) * up x)`` (module docstring).

    Args: g: the open GGUF; prefix ``"blk.N."``; dim / ff: the widths D and F (ints or `strata_jax.config.Dim` s);
    act: ``silu`` or ``gelu_tanh``; device.

    Raises:
      StrataError: a missing ``ffn_gate`` / ``ffn_up`` / ``ffn_down`` tensor, or one of another shape
        (`strata_jax.layers.linear.check_tensor`).
    """

    def __init__(self, g, prefix: str, *, dim: int, ff: int, act: str = "silu", device=None):
        self.gate = QLinear.from_gguf(g, prefix + "ffn_gate.weight", device, shape=(ff, dim))
        self.up = QLinear.from_gguf(g, prefix + "ffn_up.weight", device, shape=(ff, dim))
        self.down = QLinear.from_gguf(g, prefix + "ffn_down.weight", device, shape=(dim, ff))
        self.act = act

    def __call__(self, x: jax.Array, exact_rows: bool) -> jax.Array:
        """x float32 [..., D] -> float32 [..., D]; ``exact_rows`` as `QLinear.__call__`."""
        gate, up = project_shared(x, (self.gate, self.up), exact_rows)
        return self.down(mlp_act(self.act)(gate) * up, exact_rows)


def make_ffn(g, prefix: str, cfg, device=None):
    """The FFN of block ``prefix`` as ``cfg`` describes it: `MoE` (top ``n_expert_used`` of ``n_expert``, top-k weights
    renormalised: every family here does, llama.cpp hard-codes it for each of them) when ``cfg.n_expert > 0``, else a
    `GatedMLP` with ``cfg.mlp_act``. Both are called as ``ffn(x [B, T, D], exact_rows) -> [B, T, D]``; their tensors
    are expected at the config's widths (`strata_jax.config.shape_dims`)."""
    d = shape_dims(g, cfg)
    if cfg.n_expert > 0:
        return MoE(g, prefix, dim=d.n_embd, n_expert=d.n_expert, expert_ff=d.expert_ff, shared_ff=d.shared_ff,
                   n_used=cfg.n_expert_used, renorm=True, device=device)
    return GatedMLP(g, prefix, dim=d.n_embd, ff=d.n_ff, act=cfg.mlp_act, device=device)
