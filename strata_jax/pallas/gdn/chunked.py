"""Chunked Pallas kernels for the gated delta rule in prefill (Triton lowering on GPU; interpret mode elsewhere).

The maths of `reference.gdn_chunked` (the WY / UT-transform form, after HF ``torch_chunk_gated_delta_rule``) as
kernels on [C, D] tiles, C = `CHUNK` rows (a compile-time constant), so the products run on tensor cores:

1. `_prepare_blocked_kernel` (``solve="blocked"``) or `_prepare_kernel` (``solve="rows"``), one
   program per (segment b, v-head h, chunk c), all chunks in parallel. With ``G = cumsum(g)`` over the chunk's
   rows (log decay since the chunk's start) and the strictly lower-triangular

       L[i, j] = beta_i exp(G_i - G_j) k_i . k_j        (j < i),

   the UT transform ``A = (I + L)^-1`` is a triangular solve in a fixed order: "rows" takes one row of A per step
   (``A[i] = e_i - sum_{j<i} L[i, j] A[j]``, 63 steps on [C, C] tiles on the vector units), "blocked" inverts the
   `SOLVE_BLOCK`-row diagonal blocks that way and forms the blocks below them with tile products
   (``A_ij = -A_ii sum_m L_im A_mj``; as stable as a triangular solve, no powers of L). The program writes
   ``u = A (beta v)`` [C, Dv], ``w = A (beta exp(G) k)`` [C, Dk] and G [C] (the later kernels read G rather than
   summing again: every kernel uses the same bits).
2. The state carried over the chunks in order, one program per (segment b, v-head h, tile of BV value columns)
   with its [Dk, BV] slice of the state S in registers (float32):

       delta = u - w S                                  (the chunk's delta-rule corrections)
       o     = (exp(G) q) S + P delta,   P[i, j] = exp(G_i - G_j) q_i . k_j   (j <= i, else 0)
       S     = exp(G_last) S + (exp(G_last - G) k)^T delta

   ``carry="split"``: `_state_kernel` runs only the serial part (delta and S; it stores each
   chunk's starting state Sc [B, H, n_chunks, Dk, Dv] and delta), then `_output_kernel` forms o for every
   (chunk, tile of ``BV_out`` columns) in parallel. ``carry="fused"`` (`_carry_kernel`) forms o inside the loop.
   A column of S only depends on the same column of S, so the Dv tiles are independent.

The model's pair comes from ``STRATA_GDN_PREFILL`` (`prefill_variant`); `gdn_chunked_kernel`'s own defaults are
the blocked solve and the split carry.

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
of C. The split carry also writes Sc [B,H,Tp/C,Dk,Dv] f32 (each chunk's starting state: 4 Dk Dv / C bytes per
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


def _prepare_blocked_kernel(k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, G_ref, *, C, CB, interpret):
    """`_prepare_kernel` with a blocked solve: the chunk's C rows as C // CB blocks of CB rows (Python-unrolled).

    (I + L)^-1 = A by blocks: A_ii = (I + L_ii)^-1 (forward substitution on a [CB, CB] tile) and, for i > j,
    A_ij = -A_ii sum_{m=j}^{i-1} L_im A_mj (tile products on the tensor cores), in a fixed order. G comes from a
    masked sum over the chunk's g per block (G_i[r] = sum_{j <= i CB + r} g_j), computed once per block and used
    for every product of that block and for the carry (written to G_ref)."""
    b = pl.program_id(0)
    h = pl.program_id(1)
    base = pl.program_id(2) * C
    prec = dispatch.f32_dot_precision(interpret)
    NB = C // CB
    g = g_ref[b, pl.ds(base, C), h].astype(F32)                     # [C]
    cb_r = lax.broadcasted_iota(jnp.int32, (CB, C), 0)
    c_c = lax.broadcasted_iota(jnp.int32, (CB, C), 1)
    ks, betas, Gs, vbs, kbs = [], [], [], [], []                    # per block, each computed once
    for i in range(NB):
        rows = pl.ds(base + i * CB, CB)
        ks.append(k_ref[b, rows, h, :].astype(F32))                 # [CB, Dk]
        betas.append(beta_ref[b, rows, h].astype(F32))              # [CB]
        Gs.append(jnp.sum(jnp.where(c_c <= cb_r + i * CB, g[None, :], 0.0), axis=1))  # [CB]
        vbs.append(v_ref[b, rows, h, :].astype(F32) * betas[i][:, None])             # beta v   [CB, Dv]
        kbs.append(ks[i] * (betas[i] * jnp.exp(Gs[i]))[:, None])                    # beta exp(G) k

    A = {}
    for i in range(NB):
        A[i, i] = _ut_inverse(_lower_t(ks[i], betas[i], Gs[i], prec), CB)
        # L_im (m < i: every entry below the diagonal), each formed once for the blocks A_ij below
        L = [betas[i][:, None] * jnp.exp(Gs[i][:, None] - Gs[m][None, :]) * _dot(ks[i], ks[m], ((1,), (1,)), prec)
             for m in range(i)]
        for j in range(i):
            acc = _dot(L[j], A[j, j], ((1,), (0,)), prec)
            for m in range(j + 1, i):
                acc = acc + _dot(L[m], A[m, j], ((1,), (0,)), prec)
            A[i, j] = -_dot(A[i, i], acc, ((1,), (0,)), prec)
    for i in range(NB):
        rows = pl.ds(base + i * CB, CB)
        u = w = None
        for j in range(i + 1):
            du = _dot(A[i, j], vbs[j], ((1,), (0,)), prec)
            dw = _dot(A[i, j], kbs[j], ((1,), (0,)), prec)
            u = du if u is None else u + du
            w = dw if w is None else w + dw
        u_ref[b, rows, h, :] = u
        w_ref[b, rows, h, :] = w
        G_ref[b, rows, h] = Gs[i]


def _carry_kernel(slot_ref, S0_ref, q_ref, k_ref, G_ref, w_ref, u_ref, o_ref, S_ref, *, C, n_chunks, BV,
                  interpret):
    b = pl.program_id(0)
    h = pl.program_id(1)
    cols = pl.ds(pl.program_id(2) * BV, BV)
    prec = dispatch.f32_dot_precision(interpret)
    slot = slot_ref[b]

    def body(c, S):
        rows = pl.ds(c * C, C)
        q = q_ref[b, rows, h, :].astype(F32)                        # [C, Dk]
        k = k_ref[b, rows, h, :].astype(F32)
        w = w_ref[b, rows, h, :]                                    # [C, Dk]
        u = u_ref[b, rows, h, cols]                                 # [C, BV]
        G = G_ref[b, rows, h]                                       # the prepare kernel's cumsum (same bits)
        delta = u - _dot(w, S, ((1,), (0,)), prec)                  # [C, BV]
        o_ref[b, rows, h, cols] = _chunk_outputs(q, k, G, S, delta, prec)
        return _next_state(k, G, S, delta, prec)

    S = lax.fori_loop(0, n_chunks, body, S0_ref[slot, h, :, cols].astype(F32))
    S_ref[slot, h, :, cols] = S


def _state_kernel(slot_ref, S0_ref, k_ref, G_ref, w_ref, u_ref, Sc_ref, d_ref, S_ref, *, C, n_chunks, BV,
                  interpret):
    """The serial half of `_carry_kernel`: per chunk, store the state at its start (Sc) and its corrections
    (delta), then carry the state; the outputs come from `_output_kernel`, all chunks in parallel."""
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


SOLVES = ("blocked", "rows")  # the UT transform: 16-row blocks with tile products / one row per step
CARRIES = ("split", "fused")  # the chunk loop: state only, outputs in parallel after it / outputs inside the loop
SOLVE_BLOCK = 16  # rows per diagonal block of the blocked solve (the smallest tensor-core tile)
# STRATA_GDN_PREFILL: the (solve, carry) pair of the model's prefill; "rows" (rows, fused) are the kernels measured
# since 2026-12-02, "blocked" (blocked, split) the new pair, not yet timed on a GPU
PREFILL_VARIANTS = {"rows": ("rows", "fused"), "blocked": ("blocked", "split")}
DEFAULT_PREFILL = "rows"


def prefill_variant() -> tuple[str, str]:
    """(solve, carry) of `api.gdn_chunked`'s kernel path from ``STRATA_GDN_PREFILL`` (`PREFILL_VARIANTS`; default
    `DEFAULT_PREFILL`). Read when a call is traced (the api passes it as a static argument).

    Raises:
      UnsupportedError: another value."""
    return PREFILL_VARIANTS[dispatch.env_choice("STRATA_GDN_PREFILL", DEFAULT_PREFILL, tuple(PREFILL_VARIANTS))]


def gdn_chunked_kernel(slot, S0, q, k, v, g, beta, *, interpret: bool, C: int = CHUNK, BV: int | None = None,
                       num_warps: int = 4, solve: str = "blocked", carry: str = "split", BV_out: int = 64,
                       out_warps: int = 4, state_stages: int = 1):
    """All T rows of each segment b from the state ``S0[slot[b]]``, chunked (see the module docstring).

    Args: slot int32 [B] (distinct); S0 [N,H,Dk,Dv] float32; q, k [B,T,H,Dk], v [B,T,H,Dv] float32/bfloat16/
      float16; g, beta [B,T,H] float32. Dk, Dv powers of two >= 16 (`kernel.why_not`), BV (default `block_v`)
      and BV_out (capped at Dv) powers of two >= 16 dividing Dv; C (rows per chunk) a multiple of `SOLVE_BLOCK`
      for the blocked solve. ``solve`` in `SOLVES`, ``carry`` in `CARRIES` (launch variants of the same maths;
      ``BV_out`` / ``out_warps``: the output kernel's value tile and warps with carry="split";
      ``state_stages``: Triton's pipelining stages of the chunk loop).
    Returns: (o [B,T,H,Dv] float32, S [N,H,Dk,Dv] float32: S0 with the segments' slots replaced by their states
      after the T rows, written in place).
    Raises: ValueError for an unknown ``solve`` / ``carry``, a value tile that does not divide Dv, or a C the
      blocked solve cannot cut.
    Not jitted here (the api jits it, with the poisoning flag in the cache key).
    """
    if solve not in SOLVES or carry not in CARRIES:
        raise ValueError(f"gdn_chunked_kernel: solve={solve!r} (one of {SOLVES}), carry={carry!r} (one of {CARRIES})")
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    BV = BV or block_v(Dv)
    BV_out = min(BV_out, Dv)
    for name, tile in (("BV", BV), ("BV_out", BV_out)):
        if not dispatch.is_pow2(tile) or tile < 16 or Dv % tile:
            raise ValueError(f"gdn_chunked_kernel: {name}={tile} must be a power of two >= 16 dividing Dv={Dv}")
    if solve == "blocked" and C % min(SOLVE_BLOCK, C):
        raise ValueError(f"gdn_chunked_kernel: the blocked solve needs C={C} to be a multiple of {SOLVE_BLOCK}")
    Tp = pad_rows(T, C)
    if Tp != T:  # zero rows: k = 0, g = 0, beta = 0 change nothing (q, v = 0 keep the padded outputs finite)
        pad = lambda a: jnp.pad(a, [(0, 0), (0, Tp - T)] + [(0, 0)] * (a.ndim - 2))
        q, k, v, g, beta = (pad(a) for a in (q, k, v, g, beta))
    n_chunks = Tp // C
    full = pl.no_block_spec
    if solve == "blocked":
        prep = functools.partial(_prepare_blocked_kernel, C=C, CB=min(SOLVE_BLOCK, C), interpret=interpret)
    else:
        prep = functools.partial(_prepare_kernel, C=C, interpret=interpret)
    prepare = dispatch.pallas_call(
        prep,
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dk), F32), jax.ShapeDtypeStruct((B, Tp, H, Dv), F32),
                   jax.ShapeDtypeStruct((B, Tp, H), F32)],
        grid=(B, H, n_chunks), in_specs=[full] * 4, out_specs=[full] * 3, interpret=interpret,
        num_warps=num_warps, num_stages=1, name="gdn_chunk_prepare")
    w, u, G = prepare(k, v, g.astype(F32), beta.astype(F32))
    slot = slot.astype(jnp.int32)
    if carry == "fused":
        call = dispatch.pallas_call(
            functools.partial(_carry_kernel, C=C, n_chunks=n_chunks, BV=BV, interpret=interpret),
            out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dv), F32), jax.ShapeDtypeStruct(S0.shape, F32)],
            grid=(B, H, Dv // BV), in_specs=[full] * 7, out_specs=[full] * 2, interpret=interpret,
            num_warps=num_warps, num_stages=state_stages, name="gdn_chunk_carry", input_output_aliases={1: 1})
        o, S = call(slot, S0.astype(F32), q, k, G, w, u)
    else:
        state = dispatch.pallas_call(
            functools.partial(_state_kernel, C=C, n_chunks=n_chunks, BV=BV, interpret=interpret),
            out_shape=[jax.ShapeDtypeStruct((B, H, n_chunks, Dk, Dv), F32),
                       jax.ShapeDtypeStruct((B, Tp, H, Dv), F32), jax.ShapeDtypeStruct(S0.shape, F32)],
            grid=(B, H, Dv // BV), in_specs=[full] * 6, out_specs=[full] * 3, interpret=interpret,
            num_warps=num_warps, num_stages=state_stages, name="gdn_chunk_state", input_output_aliases={1: 2})
        Sc, delta, S = state(slot, S0.astype(F32), k, G, w, u)
        out = dispatch.pallas_call(
            functools.partial(_output_kernel, C=C, BV=BV_out, interpret=interpret),
            out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dv), F32)],
            grid=(B, H, n_chunks, Dv // BV_out), in_specs=[full] * 5, out_specs=[full], interpret=interpret,
            num_warps=out_warps, num_stages=1, name="gdn_chunk_output")
        (o,) = out(q, k, G, Sc, delta)
    return (o if Tp == T else o[:, :T]), S
