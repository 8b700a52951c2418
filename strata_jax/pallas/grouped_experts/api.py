"""Public API: `moe_experts`, the routed experts of a MoE block (SwiGLU, GGUF-quantized stacked weights).

Source: the MoE block (routed expert e: ``down_e(silu(gate_e x) * up_e x)``, output ``sum_k w_k expert_k(x)``);
HF transformers Qwen3-Next / Qwen3.5-MoE sparse MoE block; GGUF tensors ``ffn_{gate,up,down}_exps`` (ggml ne
[H, n_ff, E] for gate/up and [n_ff, H, E] for down, i.e. numpy [E, n_ff, row] and [E, H, row]).

``moe_experts(x, topk_ids, topk_w, gate, up, down, qtypes, *, impl="auto", prefill=False) -> float32 [M, H]``

* ``x`` [M, H] float32/bfloat16/float16: the mixed activations of M rows (window rows or tokens).
* ``topk_ids`` [M, k] int32: each row's selected experts (distinct within a row, 0 <= id < E; the router's
  top-k order). ``topk_w`` [M, k] float32: their (renormalised) weights.
* ``gate``, ``up``: [E, n_ff, row_bytes(H)] uint8 stacked GGUF matrices (or [E, n_ff, H] F32/F16/BF16);
  ``down``: [E, H, row_bytes(n_ff)].
* ``qtypes``: one `GGMLQuantizationType` for all three, or a (gate, up, down) triple.
* Result: ``out[m] = sum_j topk_w[m, j] * down_e(silu(gate_e x_m) * up_e x_m)``, e = topk_ids[m, j], float32,
  summed in slot order j = 0..k-1. The shared expert and its sigmoid gate are not part of this op.
* ``prefill``: the rows are a prefill chunk (not a verify window). Only planar weights use it: the rows, however
  many, then take the grouped tensor-core GEMM (rows sorted by expert), whose bits differ from the GEMV's.
* Planar weights (uint32, `strata_jax.pallas.quant_matmul.planar`; ``STRATA_QMATMUL=planar`` at load): the planar
  kernels, ``STRATA_QMATMUL_GEMV`` / ``STRATA_QMATMUL_PRECISION`` / ``STRATA_QMATMUL_GEMM`` as for
  `strata_jax.pallas.quant_matmul.qmatmul` (the grouped GEMM at `gemm.DEFAULT_PRECISION`, ``f16``: one float16
  product).

Paths: the reference computes each (row, expert) pair with the row-chunked qmatmul reference; the kernel
(formats with a quant_matmul kernel: Q2_K and Q4_0 of the Qwen3.8-Flash-Next experts included) reads each expert of
the window's union once (M <= 8), or of each 8-row group's union once (M > 8: windows of several segments,
prefill chunks). Each path is row-independent (row m of an M-row call == the row alone, bit for bit, for any M);
they agree to ~1e-5 relative, not bitwise (the planar prefill GEMM at its default f16: ~4e-4 of the largest output).

Errors: `strata_jax.errors.UnsupportedError` for inconsistent shapes, an unknown impl, or impl="kernel"/"interpret"
where the kernel cannot serve (see `strata_jax.pallas.quant_matmul.kernel.why_not`). Expert ids out of range are
not checked (jnp gathers clamp them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from strata_jax.errors import UnsupportedError
from strata_jax.gguf import blocks
from strata_jax.pallas import dispatch
from strata_jax.pallas.grouped_experts import kernel as _k
from strata_jax.pallas.grouped_experts import reference as _ref
from strata_jax.pallas.quant_matmul import api as _qapi
from strata_jax.pallas.quant_matmul import gemv as _gemv
from strata_jax.pallas.quant_matmul import kernel as _qk
from strata_jax.pallas.quant_matmul import planar as _qplanar
from strata_jax.pallas.quant_matmul.api import check_args


def _check(x, topk_ids, topk_w, gate, up, down, qtypes):
    op = "grouped_experts.moe_experts"
    if not isinstance(qtypes, (tuple, list)):
        qtypes = (qtypes,) * 3
    if len(qtypes) != 3:
        raise UnsupportedError(f"{op}: qtypes must be one format or a (gate, up, down) triple")
    qtypes = tuple(blocks.check_supported(q) for q in qtypes)
    if x.ndim != 2:
        raise UnsupportedError(f"{op}: x has shape {x.shape}, expected [M, H]")
    M, H = x.shape
    if topk_ids.ndim != 2 or topk_ids.shape[0] != M or topk_w.shape != topk_ids.shape:
        raise UnsupportedError(f"{op}: topk_ids {topk_ids.shape} / topk_w {topk_w.shape} must both be [{M}, k]")
    if gate.ndim != 3 or up.shape[:2] != gate.shape[:2] or down.ndim != 3 or down.shape[:2] != (gate.shape[0], H):
        raise UnsupportedError(f"{op}: gate {gate.shape} / up {up.shape} must be [E, n_ff, row] and down "
                               f"{down.shape} [E, {H}, row]")
    n_ff = gate.shape[1]
    check_args(x, gate[0], qtypes[0], n_ff, H, op + " (gate)")
    check_args(x, up[0], qtypes[1], n_ff, H, op + " (up)")
    check_args(jnp.zeros((1, n_ff)), down[0], qtypes[2], H, n_ff, op + " (down)")
    return qtypes


def _planar(gate, up, down, qtypes) -> bool:
    """Whether all three stacks go to the planar kernels (one family per call)."""
    H, n_ff = down.shape[1], gate.shape[1]
    stacks, ks = (gate, up, down), (H, H, n_ff)
    flags = [_qapi.uses_planar_kernels(w, q, kk) for q, w, kk in zip(qtypes, stacks, ks)]
    if any(flags) and not all(flags):
        # Float stacks follow the repacked ones; with none repacked (float experts whose K is not a multiple of
        # 32 on one side) the call goes to the bytes family, which takes any K.
        if not any(_qplanar.is_planar(w, q) for q, w in zip(qtypes, stacks)):
            return False
        raise UnsupportedError("grouped_experts.moe_experts: gate/up/down must all be planar or all GGUF bytes")
    return all(flags)


def _why_not(x, topk_ids, gate, up, down, qtypes, planar):
    M, H = x.shape
    E, n_ff = gate.shape[:2]
    for q, w, n, kk in ((qtypes[0], gate, n_ff, H), (qtypes[1], up, n_ff, H), (qtypes[2], down, H, n_ff)):
        r = (_gemv.why_not(q, n, kk, w.dtype, n_mats=E) if planar
             else _qk.why_not(q, M, n, kk, x.dtype, w.dtype, n_mats=E, row_groups=True))
        if r is not None:
            return r
    return None


@functools.partial(jax.jit, static_argnames=("qtypes", "path", "poison", "planar", "prefill", "gemv", "prec",
                                             "gemm_kernel"))
def _moe(x, topk_ids, topk_w, gate, up, down, *, qtypes, path, poison, planar, prefill, gemv, prec, gemm_kernel):
    if path == "reference":
        return _ref.moe_experts(x, topk_ids, topk_w, gate, up, down, qtypes)
    interpret = path == "interpret"
    with dispatch.poison_outputs(poison):
        if planar:
            f = [_qapi._as_float_weight(w.reshape(-1, w.shape[-1]), q, kk).reshape(w.shape[:2] + (-1,))
                 for w, q, kk in zip((gate, up, down), qtypes, (x.shape[1], x.shape[1], gate.shape[1]))]
            return _k.moe_experts_planar(x, topk_ids, topk_w, *f, qtypes, interpret=interpret, prefill=prefill,
                                         gemv=gemv, precision=prec, gemm_kernel=gemm_kernel)
        return _k.moe_experts_kernel(x, topk_ids, topk_w, gate, up, down, qtypes, interpret=interpret)


def moe_experts(x, topk_ids, topk_w, gate, up, down, qtypes, *, impl: str = "auto", prefill: bool = False):
    """float32 [M, H]: the weighted sum of each row's selected SwiGLU experts. See the module docstring."""
    qtypes = _check(x, topk_ids, topk_w, gate, up, down, qtypes)
    planar = _planar(gate, up, down, qtypes)
    path = dispatch.resolve("grouped_experts.moe_experts", impl,
                            lambda: _why_not(x, topk_ids, gate, up, down, qtypes, planar))
    return _moe(x, topk_ids, topk_w, gate, up, down, qtypes=qtypes, path=path, poison=dispatch.poisoning(),
                planar=planar, prefill=bool(prefill), gemv=_qapi.gemv_variant() if planar else "",
                prec=_qapi.precision(bool(prefill)) if planar else "",
                gemm_kernel=_qapi.gemm_variant() if planar else "")
