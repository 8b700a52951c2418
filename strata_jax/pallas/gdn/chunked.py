"""Chunked Pallas kernels for the gated delta rule in prefill (Triton lowering on GPU; interpret mode elsewhere).

The maths of `reference.gdn_chunked` (the WY / UT-transform form, after HF ``torch_chunk_gated_delta_rule``) as
kernels on [C, D] tiles, C = `CHUNK` rows (a compile-time constant), so the products run on tensor cores:

1. `_prepare_kernel`, one program per (segment b, v-head h, chunk c), all chunks in parallel. With
   ``G = cumsum(g)`` over the chunk's rows (log decay since the chunk's start) and the strictly lower-triangular

       L[i, j] = beta_i exp(G_i - G_j) k_i . k_j        (j < i),

   the UT transform ``A = (I + L)^-1`` is a triangular solve in a fixed order, one row of A per step
   (``A[i] = e_i - sum_{j<i} L[i, j] A[j]``, C - 1 steps on [C, C] tiles on the vector units). The program writes
   ``u = A (beta v)`` [C, Dv], ``w = A (beta exp(G) k)`` [C, Dk] and G [C] (the later kernels read G rather than
   summing again: every kernel uses the same bits).
2. `_state_kernel`: the state carried over the chunks in order (the serial part), one program per (segment b,
   v-head h, tile of BV value columns) with its [Dk, BV] slice of the state S in registers (float32):

       delta = u - w S                                  (the chunk's delta-rule corrections)
       S     = exp(G_last) S + (exp(G_last - G) k)^T delta

   storing each chunk's starting state Sc [B, H, n_chunks, Dk, Dv] and its delta. A column of S only depends on
   the same column of S, so the Dv tiles are independent.
3. `_output_kernel`, one program per (segment, head, chunk, tile of ``BV_out`` columns), all in parallel:

       o = (exp(G) q) Sc + P delta,   P[i, j] = exp(G_i - G_j) q_i . k_j   (j <= i, else 0)

Measured on an H100 (2026-12-07, experiments/RESULTS.md; Flash-Next's H = 48, Dk = Dv = 128, T = 512): this pair
552.7 us; a solve by 16-row blocks with tile products for the blocks below the diagonal 620.2 us; the outputs formed
inside the chunk loop (one kernel for steps 2 and 3) 924.9 us with this solve, 993.7 us with the blocked one: those
three variants were removed (the code as measured is at commit 3630f1d).

Arithmetic is float32 throughout. The tile products use `dispatch.f32_dot_precision`: TF32x3 on the tensor cores
when compiled (three TF32 products: about float32 accuracy), plain float32 in interpret mode. The forward
substitution, the cumulative sums and the decays run on the vector units.

Rows: the caller pads T to a multiple of C with zero rows (k = 0, g = 0, beta = 0, `pad_rows`); such a row leaves
the state unchanged (it adds exact zeros), so the final state is that of the T real rows. A row's output only
depends on the rows before it in its segment and on C: every program touches one segment (no dependence on B), the
masks make later rows of the same chunk contribute exact zeros, and later chunks come later in the carry loop.

Layouts (full-array refs, indexed explicitly): S0 [N,H,Dk,Dv] f32 (every slot's state; segment b reads and writes
``S0[slot[b]]`` in place: the output S is aliased to S0, as in `kernel.gdn_scan`), q/k [B,Tp,H,Dk], v [B,Tp,H,Dv]
(f32/bf16/f16), g/beta/G [B,Tp,H] f32, w [B,Tp,H,Dk] f32, u [B,Tp,H,Dv] f32, o [B,Tp,H,Dv] f32; Tp a multiple
of C. `_state_kernel` also writes Sc [B,H,Tp/C,Dk,Dv] f32 (each chunk's starting state: 4 Dk Dv / C bytes per
row and head, 12 MiB per Flash-Next layer at T = 512) and delta [B,Tp,H,Dv] f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from strata_jax.pallas import dispatch
from strata_jax.pallas.gdn.kernel import block_v
from strata_jax.pallas.gdn.reference import CHUNK  # the reference's chunk: the same rows meet in one solve

F32 = jnp.float32


def _dot(a, b, contract, prec):
    """a [M, K] . b [K, N] (contract ((1,), (0,))), a b^T (((1,), (1,))) or a^T b (((0,), (0,))), float32."""
    return lax.dot_general(a, b, (contract, ((), ())), precision=prec, preferred_element_type=F32)


def _decay(G, mask):
    """exp(G_i - G_j) where ``mask`` [C, C] holds, else 0 (the exponent is masked first: G_i - G_j > 0 above the
    diagonal can overflow)."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, G[:, None] - G[None, :], 0.0)), 0.0)


def _iotas(C):
    return lax.broadcasted_iota(jnp.int32, (C, C), 0), lax.broadcasted_iota(jnp.int32, (C, C), 1)


def _ut_inverse(LT, C):
    """(I + L)^-1 by forward substitution, from ``LT`` = L^T [C, C] (strictly upper: LT[j, i] = L[i, j]).

    Row i of the inverse is ``e_i - sum_{j<i} L[i, j] A[j]``; rows 0..i-1 are final when row i is computed, rows
    > i still hold e_i (and L[i, j] = 0 for j >= i), so the update can run over all rows. Taking L^T lets the row
    L[i, :] come out of a reduction along axis 1 already laid out along A's rows (no transpose in the loop)."""
    r, s = _iotas(C)
    eye = jnp.where(r == s, 1.0, 0.0).astype(F32)

    def step(i, A):
        li = jnp.sum(jnp.where(s == i, LT, 0.0), axis=1)           # li[j] = L[i, j]   [C]
        ai = jnp.sum(li[:, None] * A, axis=0)                       # sum_j L[i, j] A[j, :]
        return jnp.where(r == i, eye - ai[None, :], A)

    return lax.fori_loop(1, C, step, eye)                           # row 0 is e_0


def _lower_t(k, beta, G, prec):
    """L^T [n, n] of n rows (k [n, Dk], beta / G [n]): LT[j, i] = L[i, j] = beta_i exp(G_i - G_j) k_i . k_j for
    i > j, else 0 (rows j, columns i; the exponent masked first), the operand of `_ut_inverse`."""
    r, s = _iotas(k.shape[0])
    gram = _dot(k, k, ((1,), (1,)), prec)                           # k_r . k_s
    upper = s > r
    return jnp.where(upper, beta[None, :] * jnp.exp(jnp.where(upper, G[None, :] - G[:, None], 0.0)) * gram, 0.0)


def _chunk_outputs(q, k, G, S, delta, prec):
    """o [C, BV] = (exp(G) q) S + P delta of one chunk, P[i, j] = exp(G_i - G_j) q_i . k_j (j <= i, else 0), from
    the state S [Dk, BV] at the chunk's start and its corrections delta [C, BV]."""
    r, s = _iotas(q.shape[0])
    P = _decay(G, s <= r) * _dot(q, k, ((1,), (1,)), prec)          # [C, C]
    return _dot(q * jnp.exp(G)[:, None], S, ((1,), (0,)), prec) + _dot(P, delta, ((1,), (0,)), prec)


def _next_state(k, G, S, delta, prec):
    """The state after a chunk: exp(G_last) S + (exp(G_last - G) k)^T delta (G_last = G[C-1], read by a masked sum
    that adds exact zeros)."""
    last = lax.broadcasted_iota(jnp.int32, G.shape, 0) == G.shape[0] - 1
    G_last = jnp.sum(jnp.where(last, G, 0.0))
    kd = k * jnp.exp(G_last - G)[:, None]
    return S * jnp.exp(G_last) + _dot(kd, delta, ((0,), (0,)), prec)


def _prepare_kernel(k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, G_ref, *, C, interpret):
    b = pl.program_id(0)
    h = pl.program_id(1)
    rows = pl.ds(pl.program_id(2) * C, C)
    prec = dispatch.f32_dot_precision(interpret)
    k = k_ref[b, rows, h, :].astype(F32)                            # [C, Dk]
    v = v_ref[b, rows, h, :].astype(F32)                            # [C, Dv]
    G = jnp.cumsum(g_ref[b, rows, h].astype(F32))                   # [C]
    beta = beta_ref[b, rows, h].astype(F32)
    A = _ut_inverse(_lower_t(k, beta, G, prec), C)
    u_ref[b, rows, h, :] = _dot(A, v * beta[:, None], ((1,), (0,)), prec)
    w_ref[b, rows, h, :] = _dot(A, k * (beta * jnp.exp(G))[:, None], ((1,), (0,)), prec)
    G_ref[b, rows, h] = G


def _state_kernel(slot_ref, S0_ref, k_ref, G_ref, w_ref, u_ref, Sc_ref, d_ref, S_ref, *, C, n_chunks, BV,
                  interpret):
    """The serial part: per chunk, store the state at its start (Sc) and its corrections (delta), then carry the
    state; the outputs come from `_output_kernel`, all chunks in parallel."""
    b = pl.program_id(0)
    h = pl.program_id(1)
    cols = pl.ds(pl.program_id(2) * BV, BV)
    prec = dispatch.f32_dot_precision(interpret)
    slot = slot_ref[b]

    def body(c, S):
        rows = pl.ds(c * C, C)
        Sc_ref[b, h, c, :, cols] = S
        k = k_ref[b, rows, h, :].astype(F32)
        w = w_ref[b, rows, h, :]                                    # [C, Dk]
        u = u_ref[b, rows, h, cols]                                 # [C, BV]
        G = G_ref[b, rows, h]
        delta = u - _dot(w, S, ((1,), (0,)), prec)                  # [C, BV]
        d_ref[b, rows, h, cols] = delta
        return _next_state(k, G, S, delta, prec)

    S = lax.fori_loop(0, n_chunks, body, S0_ref[slot, h, :, cols].astype(F32))
    S_ref[slot, h, :, cols] = S


def _output_kernel(q_ref, k_ref, G_ref, Sc_ref, d_ref, o_ref, *, C, BV, interpret):
    """o = (exp(G) q) S_c + P delta for one (segment, head, chunk, tile of BV value columns)."""
    b = pl.program_id(0)
    h = pl.program_id(1)
    c = pl.program_id(2)
    cols = pl.ds(pl.program_id(3) * BV, BV)
    rows = pl.ds(c * C, C)
    prec = dispatch.f32_dot_precision(interpret)
    q = q_ref[b, rows, h, :].astype(F32)                            # [C, Dk]
    k = k_ref[b, rows, h, :].astype(F32)
    S = Sc_ref[b, h, c, :, cols]                                    # [Dk, BV]
    delta = d_ref[b, rows, h, cols]                                 # [C, BV]
    o_ref[b, rows, h, cols] = _chunk_outputs(q, k, G_ref[b, rows, h], S, delta, prec)


def pad_rows(T: int, C: int = CHUNK) -> int:
    """The padded row count: T rounded up to a multiple of C."""
    return -(-T // C) * C


def gdn_chunked_kernel(slot, S0, q, k, v, g, beta, *, interpret: bool, C: int = CHUNK, BV: int | None = None,
                       num_warps: int = 4, BV_out: int = 64, out_warps: int = 4, state_stages: int = 1):
    """All T rows of each segment b from the state ``S0[slot[b]]``, chunked (see the module docstring).

    Args: slot int32 [B] (distinct); S0 [N,H,Dk,Dv] float32; q, k [B,T,H,Dk], v [B,T,H,Dv] float32/bfloat16/
      float16; g, beta [B,T,H] float32. Dk, Dv powers of two >= 16 (`kernel.why_not`), BV (the state kernel's
      value tile, default `block_v`) and BV_out (the output kernel's, capped at Dv) powers of two >= 16 dividing
      Dv. Launch settings: ``num_warps`` of the prepare and state kernels, ``out_warps`` of the output kernel,
      ``state_stages`` (Triton's pipelining stages of the chunk loop).
    Returns: (o [B,T,H,Dv] float32, S [N,H,Dk,Dv] float32: S0 with the segments' slots replaced by their states
      after the T rows, written in place).
    Raises: ValueError for a value tile that does not divide Dv.
    Not jitted here (the api jits it, with the poisoning flag in the cache key).
    """
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    BV = BV or block_v(Dv)
    BV_out = min(BV_out, Dv)
    for name, tile in (("BV", BV), ("BV_out", BV_out)):
        if not dispatch.is_pow2(tile) or tile < 16 or Dv % tile:
            raise ValueError(f"gdn_chunked_kernel: {name}={tile} must be a power of two >= 16 dividing Dv={Dv}")
    Tp = pad_rows(T, C)
    if Tp != T:  # zero rows: k = 0, g = 0, beta = 0 change nothing (q, v = 0 keep the padded outputs finite)
        pad = lambda a: jnp.pad(a, [(0, 0), (0, Tp - T)] + [(0, 0)] * (a.ndim - 2))
        q, k, v, g, beta = (pad(a) for a in (q, k, v, g, beta))
    n_chunks = Tp // C
    full = pl.no_block_spec
    prepare = dispatch.pallas_call(
        functools.partial(_prepare_kernel, C=C, interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dk), F32), jax.ShapeDtypeStruct((B, Tp, H, Dv), F32),
                   jax.ShapeDtypeStruct((B, Tp, H), F32)],
        grid=(B, H, n_chunks), in_specs=[full] * 4, out_specs=[full] * 3, interpret=interpret,
        num_warps=num_warps, num_stages=1, name="gdn_chunk_prepare")
    w, u, G = prepare(k, v, g.astype(F32), beta.astype(F32))
    state = dispatch.pallas_call(
        functools.partial(_state_kernel, C=C, n_chunks=n_chunks, BV=BV, interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct((B, H, n_chunks, Dk, Dv), F32),
                   jax.ShapeDtypeStruct((B, Tp, H, Dv), F32), jax.ShapeDtypeStruct(S0.shape, F32)],
        grid=(B, H, Dv // BV), in_specs=[full] * 6, out_specs=[full] * 3, interpret=interpret,
        num_warps=num_warps, num_stages=state_stages, name="gdn_chunk_state", input_output_aliases={1: 2})
    Sc, delta, S = state(slot.astype(jnp.int32), S0.astype(F32), k, G, w, u)
    out = dispatch.pallas_call(
        functools.partial(_output_kernel, C=C, BV=BV_out, interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dv), F32)],
        grid=(B, H, n_chunks, Dv // BV_out), in_specs=[full] * 5, out_specs=[full], interpret=interpret,
        num_warps=out_warps, num_stages=1, name="gdn_chunk_output")
    (o,) = out(q, k, G, Sc, delta)
    return (o if Tp == T else o[:, :T]), S
