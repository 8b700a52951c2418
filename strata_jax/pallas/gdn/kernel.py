"""Pallas kernel for the gated delta rule in verify windows and commits (Triton lowering on GPU; interpret mode
elsewhere). Prefill (`api.gdn_chunked`) takes the chunked kernels of `chunked` instead.

One program per (segment b, v-head h, tile of BV value columns). The program keeps its [Dk, BV] slice of the f32
state in registers and loops over the T rows of its inputs (a trip count fixed at compile time); with ``masked``,
a step t >= n[b] (n read from memory: the rows a commit keeps) leaves the state as it was, so one compiled program
serves every n_keep. A column of S^T only depends on the same column of S, so the Dv tiles are independent; every
program reads q/k of its head once per step.

The per-step arithmetic is `reference._update` / `_readout` written for one [Dk, BV] tile; the window, commit and
scan kernels are the same body with different outputs enabled, so a state that the commit kernel writes and the
state the window kernel holds after the same steps come from the same instructions.

Layouts (all full-array refs, indexed explicitly; nothing needs to be a power of two except Dk and BV):
  S0 [N,H,Dk,Dv] f32 (every slot's state: segment b reads ``S0[slot[b]]``), q/k [B,T,H,Dk], v [B,T,H,Dv]
  (f32/bf16/f16), g/beta [B,T,H] f32, n [B] int32 (steps to keep), slot [B] int32 (distinct). The new state is
  written in place: the output S is aliased to S0 and only the B segments' slots are written, so neither the
  segments' states nor the whole state array are copied around the call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from strata_jax.pallas import dispatch


def block_v(Dv: int) -> int:
    """The value-column tile: 32 (or Dv when smaller)."""
    return min(Dv, 32)


def why_not(Dk: int, Dv: int, dtypes) -> str | None:
    """None when the kernel serves these head dims / dtypes, else the reason."""
    if not dispatch.is_pow2(Dk) or Dk < 16:
        return f"Dk={Dk} is not a power of two >= 16"
    if not dispatch.is_pow2(Dv) or Dv < 16:
        return f"Dv={Dv} is not a power of two >= 16"
    for dt in dtypes:
        if jnp.dtype(dt) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"dtype {jnp.dtype(dt).name} (needs float32/bfloat16/float16)"
    return None


def _kernel(n_ref, slot_ref, S0_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *out_refs, BV, T, masked, want_o,
            want_S):
    b = pl.program_id(0)
    h = pl.program_id(1)
    j = pl.program_id(2)
    cols = pl.ds(j * BV, BV)
    n = n_ref[b]
    slot = slot_ref[b]
    S = S0_ref[slot, h, :, cols].astype(jnp.float32)  # [Dk, BV]
    o_ref = out_refs[0] if want_o else None
    S_ref = out_refs[-1] if want_S else None

    def body(t, S):
        k = k_ref[b, t, h, :].astype(jnp.float32)
        v = v_ref[b, t, h, cols].astype(jnp.float32)
        g = g_ref[b, t, h].astype(jnp.float32)
        beta = beta_ref[b, t, h].astype(jnp.float32)
        # == reference._update on one tile
        S_old = S
        S = S * jnp.exp(g)
        kv = jnp.sum(S * k[:, None], axis=0)
        delta = beta * (v - kv)
        S = S + k[:, None] * delta[None, :]
        if masked:
            S = jnp.where(t < n, S, S_old)
        if want_o:  # == reference._readout
            q = q_ref[b, t, h, :].astype(jnp.float32)
            o_ref[b, t, h, cols] = jnp.sum(S * q[:, None], axis=0)
        return S

    S = lax.fori_loop(0, T, body, S)
    if want_S:
        S_ref[slot, h, :, cols] = S


def gdn_scan(n, slot, S0, q, k, v, g, beta, *, want_o: bool, want_S: bool, interpret: bool, masked: bool = True):
    """Run the first n[b] of the T steps of segment b from the state ``S0[slot[b]]`` (all T when not ``masked``:
    then n is not read). Returns (o [B,T,H,Dv] f32 if want_o, S [N,H,Dk,Dv] f32 if want_S: S0 with the segments'
    slots replaced by their new states, written in place).

    Not jitted here (the api jits it, with the poisoning flag in the cache key).
    Rows t >= n[b] of o hold the read-out of the unchanged state (callers ignore them).
    """
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    BV = block_v(Dv)
    out_shape = []
    if want_o:
        out_shape.append(jax.ShapeDtypeStruct((B, T, H, Dv), jnp.float32))
    if want_S:
        out_shape.append(jax.ShapeDtypeStruct(S0.shape, jnp.float32))
    full = pl.no_block_spec
    call = dispatch.pallas_call(
        functools.partial(_kernel, BV=BV, T=T, masked=masked, want_o=want_o, want_S=want_S),
        out_shape=out_shape, grid=(B, H, Dv // BV), in_specs=[full] * 8, out_specs=[full] * len(out_shape),
        interpret=interpret, num_warps=4, num_stages=1, name="gdn_scan",
        input_output_aliases={2: len(out_shape) - 1} if want_S else None)
    return call(n.astype(jnp.int32), slot.astype(jnp.int32), S0.astype(jnp.float32), q, k, v, g.astype(jnp.float32),
                beta.astype(jnp.float32))
