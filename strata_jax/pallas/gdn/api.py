"""Public API of the gated delta rule ops: `gdn_window`, `gdn_commit`, `gdn_chunked`.

Sources: "Gated Delta Networks: Improving Mamba2 with Delta Rule" (Yang, Kautz, Hatamizadeh, 2024); HF transformers
``modeling_qwen3_next.torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` (the GDN
mixer); a verify window has T <= 8 rows, and its commit replays the accepted rows.

Conventions for all three ops (one state per (segment b, v-head h)):
  * ``S0`` [B, H, Dk, Dv] float32: the recurrent state before the first row; or, with ``slots`` int32 [B] (distinct
    slot indices), every slot's state [N, H, Dk, Dv] of which segment b reads ``S0[slots[b]]`` (the kernel reads
    and writes the slots in place: no gather of the segments' states, no scatter back). The caller's array is never
    modified (JAX semantics; a donated state buffer is updated in place).
  * ``q``, ``k`` [B, T, H, Dk] float32/bfloat16/float16: already L2-normalised, ``q`` already scaled by Dk**-0.5,
    and already expanded from the key heads to the H value heads by the caller (whatever head grouping the model
    uses). ``v`` [B, T, H, Dv], same dtypes.
  * ``g`` [B, T, H] float32: the log decay (<= 0 in the model; the step multiplies S by exp(g)).
  * ``beta`` [B, T, H] float32: the delta-rule write strength (sigmoid output, in (0, 1) in the model).
  * Per step: ``S = exp(g) S; delta = beta (v - S^T k); S = S + k delta^T; o = S^T q``. All arithmetic in float32.
  * The B segments are independent (batch slots / sequences).

``impl`` is one of "auto" | "reference" | "kernel" | "interpret" (see `strata_jax.pallas.dispatch`).

Errors: `strata_jax.errors.UnsupportedError` for inconsistent shapes, T > 8 in the window/commit ops, an unknown
impl, or impl="kernel"/"interpret" for shapes the kernel cannot serve (Dk, Dv must be
powers of two >= 16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from strata_jax.errors import UnsupportedError
from strata_jax.pallas import dispatch
from strata_jax.pallas.gdn import chunked as _c
from strata_jax.pallas.gdn import kernel as _k
from strata_jax.pallas.gdn import reference as _ref

T_MAX = _ref.T_MAX


def _check(S0, q, k, v, g, beta, *, t_max=None, op, slots=None):
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    n = B if slots is None else S0.shape[0]
    if S0.shape != (n, H, Dk, Dv):
        raise UnsupportedError(f"{op}: S0 has shape {S0.shape}, expected {(n, H, Dk, Dv)} from k {k.shape} / v {v.shape}")
    if slots is not None and slots.shape != (B,):
        raise UnsupportedError(f"{op}: slots has shape {slots.shape}, expected {(B,)}")
    if q is not None and q.shape != k.shape:
        raise UnsupportedError(f"{op}: q has shape {q.shape}, k has {k.shape}")
    if v.shape[:3] != (B, T, H):
        raise UnsupportedError(f"{op}: v has shape {v.shape}, expected {(B, T, H, '*')}")
    for name, a in (("g", g), ("beta", beta)):
        if a.shape != (B, T, H):
            raise UnsupportedError(f"{op}: {name} has shape {a.shape}, expected {(B, T, H)}")
    if t_max is not None and not 1 <= T <= t_max:
        raise UnsupportedError(f"{op}: T={T} rows; the verify-window ops take 1 <= T <= {t_max}")
    return B, T, H, Dk, Dv


def _why_not(k, v, *arrays):
    return lambda: _k.why_not(k.shape[-1], v.shape[-1], [a.dtype for a in arrays])


def _slots(slots, B):
    return jnp.arange(B, dtype=jnp.int32) if slots is None else slots.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("path", "poison"))
def _window(S0, q, k, v, g, beta, slots, *, path, poison):
    if path == "reference":
        return _ref.gdn_window(S0 if slots is None else S0[slots], q, k, v, g, beta)
    B, T = q.shape[:2]
    interpret = path == "interpret"
    if interpret:
        # Interpret mode inlines the kernel into XLA: pad to T_MAX rows (the padding rows masked), so every T runs
        # the very same program. (The compiled kernel runs T steps; each step's arithmetic does not depend on T,
        # tested on the GPU.)
        q, k, v, g, beta = (_ref._pad_t(a) for a in (q, k, v, g, beta))
    with dispatch.poison_outputs(poison):
        (o,) = _k.gdn_scan(jnp.full((B,), T, jnp.int32), _slots(slots, B), S0, q, k, v, g, beta, want_o=True,
                           want_S=False, interpret=interpret, masked=interpret)
    return o[:, :T]


def gdn_window(S0, q, k, v, g, beta, *, slots=None, impl: str = "auto"):
    """Outputs of a verify window of T <= 8 rows, reading (never writing) the state.

    Args: S0 [B,H,Dk,Dv] f32 (or [N,H,Dk,Dv] with ``slots`` [B]); q, k [B,T,H,Dk]; v [B,T,H,Dv]; g, beta [B,T,H]
      f32 (see the module docstring).
    Returns: o [B,T,H,Dv] float32, o[:, t] = S_{t+1}^T q_t where S_{t+1} is the state after rows 0..t.
    Exactness: o[:, t] is bit-identical to ``gdn_window(gdn_commit(S0, ..., n_keep=t), row t alone)`` and does not
    depend on rows > t (for each impl separately).
    """
    _check(S0, q, k, v, g, beta, t_max=T_MAX, op="gdn.gdn_window", slots=slots)
    path = dispatch.resolve("gdn.gdn_window", impl, _why_not(k, v, q, k, v))
    return _window(S0, q, k, v, g, beta, slots, path=path, poison=dispatch.poisoning())


def _scatter(S0, S, slots):
    return S if slots is None else S0.at[slots].set(S)


@functools.partial(jax.jit, static_argnames=("path", "poison"))
def _commit(S0, k, v, g, beta, n_keep, slots, *, path, poison):
    B, T = k.shape[:2]
    n_keep = jnp.clip(n_keep.astype(jnp.int32), 0, T)
    if path == "reference":
        return _scatter(S0, _ref.gdn_commit(S0 if slots is None else S0[slots], k, v, g, beta, n_keep), slots)
    interpret = path == "interpret"
    if interpret:  # see _window
        k, v, g, beta = (_ref._pad_t(a) for a in (k, v, g, beta))
    with dispatch.poison_outputs(poison):
        (S,) = _k.gdn_scan(n_keep, _slots(slots, B), S0, k, k, v, g, beta, want_o=False, want_S=True,
                           interpret=interpret)
    return S


def gdn_commit(S0, k, v, g, beta, n_keep, *, slots=None, impl: str = "auto"):
    """The state after each segment's first ``n_keep[b]`` rows of a window (the commit).

    Args: S0 [B,H,Dk,Dv] f32 (or [N,H,Dk,Dv] with ``slots`` [B]); k [B,T,H,Dk]; v [B,T,H,Dv]; g, beta [B,T,H] f32;
      n_keep [B] int32 with 0 <= n_keep[b] <= T (values outside are clipped; n_keep = 0 keeps the segment's state).
      T <= 8.
    Returns: S float32 of S0's shape: the segments' new states (with ``slots``: S0 with those slots replaced).
    Exactness: equals n_keep[b] successive one-row commits bit for bit, and the state the window held after the
    same rows.
    """
    _check(S0, None, k, v, g, beta, t_max=T_MAX, op="gdn.gdn_commit", slots=slots)
    if n_keep.shape != (k.shape[0],):
        raise UnsupportedError(f"gdn.gdn_commit: n_keep has shape {n_keep.shape}, expected {(k.shape[0],)}")
    path = dispatch.resolve("gdn.gdn_commit", impl, _why_not(k, v, k, v))
    return _commit(S0, k, v, g, beta, n_keep, slots, path=path, poison=dispatch.poisoning())


@functools.partial(jax.jit, static_argnames=("path", "poison"))
def _chunked(S0, q, k, v, g, beta, slots, *, path, poison):
    if path == "reference":
        o, S = _ref.gdn_chunked(S0 if slots is None else S0[slots], q, k, v, g, beta)
        return o, _scatter(S0, S, slots)
    with dispatch.poison_outputs(poison):
        return _c.gdn_chunked_kernel(_slots(slots, q.shape[0]), S0, q, k, v, g, beta,
                                     interpret=path == "interpret")


def gdn_chunked(S0, q, k, v, g, beta, *, slots=None, impl: str = "auto"):
    """Prefill: all T rows (any T >= 1) of each segment, returning the outputs and the final state.

    Args: as `gdn_window`, any T.
    Returns: (o [B,T,H,Dv] float32, S float32 of S0's shape: the segments' states after their T rows).
    Both paths run the chunked WY algorithm (chunk 64, after HF ``torch_chunk_gated_delta_rule``): the reference in
    jnp, the kernel path as Pallas kernels (`chunked`: the chunks' UT transforms in parallel, then the state
    carried over the chunks, then every chunk's outputs in parallel; products on tensor cores). Both agree with a
    float64 recurrence to ~1e-5 relative, not bit for bit with each other. Kernel path: a row's output depends only
    on its position and the rows before it in its segment (not on B, nor on T beyond it).
    """
    _check(S0, q, k, v, g, beta, op="gdn.gdn_chunked", slots=slots)
    path = dispatch.resolve("gdn.gdn_chunked", impl, _why_not(k, v, q, k, v))
    return _chunked(S0, q, k, v, g, beta, slots, path=path, poison=dispatch.poisoning())
