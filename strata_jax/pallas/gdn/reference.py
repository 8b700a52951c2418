"""Plain-jnp reference of the gated delta rule (the numerical spec of `strata_jax.pallas.gdn`).

Source: "Gated Delta Networks: Improving Mamba2 with Delta Rule" (Yang, Kautz, Hatamizadeh, 2024), eq. (10);
HF transformers ``modeling_qwen3_next.torch_recurrent_gated_delta_rule`` (the per-step form used here) and
``torch_chunk_gated_delta_rule`` (the chunked form of `gdn_chunked`).

Per v-head, with f32 state ``S`` of shape [Dk, Dv] and one step's ``q, k`` [Dk], ``v`` [Dv], scalars ``g, beta``:

    S     = exp(g) * S
    delta = beta * (v - S^T k)
    S     = S + k delta^T
    o     = S^T q                  (read out after the update)

Exactness: `gdn_window` and `gdn_commit` run the SAME step function (`_update`, and `_readout` for the window)
inside a loop whose trip count is a runtime value and whose inputs are padded to `T_MAX` rows, so the compiled
program is the same for every T <= 8 and every row is computed by the same instructions from the same state. Row t
of a T-row window therefore equals a 1-row window on the state after t steps, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from strata_jax.layers.exact import pairwise_sum

T_MAX = 8  # the verify window's largest T (the last token + up to 7 proposals)
CHUNK = 64  # gdn_chunked's chunk length (HF torch_chunk_gated_delta_rule's default)


def _update(S, k, v, g, beta):
    """One state update. S [B,H,Dk,Dv] f32; k [B,H,Dk] f32; v [B,H,Dv] f32; g, beta [B,H] f32 -> S' [B,H,Dk,Dv].
    The sum over Dk is a fixed pairwise tree (`exact.pairwise_sum`): XLA's reduce would order it by B."""
    S = S * jnp.exp(g)[..., None, None]
    kv = pairwise_sum(S * k[..., :, None], axis=-2)[..., 0, :]  # S^T k  [B,H,Dv]
    delta = beta[..., None] * (v - kv)
    return S + k[..., :, None] * delta[..., None, :]


def _readout(S, q):
    """o = S^T q. S [B,H,Dk,Dv] f32; q [B,H,Dk] f32 -> [B,H,Dv] f32 (the sum as in `_update`)."""
    return pairwise_sum(S * q[..., :, None], axis=-2)[..., 0, :]


def gdn_step(S, q, k, v, g, beta):
    """One full step (update, then read-out): returns (S', o). Shapes as in `_update` / `_readout`."""
    S = _update(S, k, v, g, beta)
    return S, _readout(S, q)


def _opaque(n) -> jax.Array:
    """An int32 scalar whose value XLA cannot see at compile time (keeps loop trip counts dynamic)."""
    return lax.optimization_barrier(jnp.asarray(n, jnp.int32))


def _pad_t(x, t_max=T_MAX):
    T = x.shape[1]
    if T == t_max:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, t_max - T)
    return jnp.pad(x, pad)


def _f32(*xs):
    return [x.astype(jnp.float32) for x in xs]


def gdn_window(S0, q, k, v, g, beta):
    """Verify-window outputs. See `strata_jax.pallas.gdn.api.gdn_window` for the contract."""
    T = q.shape[1]
    q, k, v, g, beta = (_pad_t(a) for a in _f32(q, k, v, g, beta))
    S0 = S0.astype(jnp.float32)
    B, _, H, Dv = v.shape
    o0 = jnp.zeros((B, T_MAX, H, Dv), jnp.float32)

    def body(t, carry):
        S, o = carry
        S, ot = gdn_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        return S, lax.dynamic_update_index_in_dim(o, ot, t, axis=1)

    _, o = lax.fori_loop(0, _opaque(T), body, (S0, o0))
    return o[:, :T]


def gdn_commit(S0, k, v, g, beta, n_keep):
    """State after each segment's first n_keep[b] steps. See `api.gdn_commit`."""
    k, v, g, beta = (_pad_t(a) for a in _f32(k, v, g, beta))
    S0 = S0.astype(jnp.float32)
    n_keep = n_keep.astype(jnp.int32)

    def body(t, S):
        S_new = _update(S, k[:, t], v[:, t], g[:, t], beta[:, t])
        return jnp.where((t < n_keep)[:, None, None, None], S_new, S)

    return lax.fori_loop(0, jnp.max(n_keep, initial=0), body, S0)


def gdn_recurrent(S0, q, k, v, g, beta):
    """The plain recurrence for any T (a `lax.scan` of `gdn_step`): returns (o [B,T,H,Dv], S_T)."""
    S0 = S0.astype(jnp.float32)
    xs = [jnp.moveaxis(a, 1, 0) for a in _f32(q, k, v, g, beta)]

    def body(S, x):
        return gdn_step(S, *x)

    S, o = lax.scan(body, S0, xs)
    return jnp.moveaxis(o, 0, 1), S


def gdn_chunked(S0, q, k, v, g, beta, chunk: int = CHUNK):
    """Chunked (WY-form) gated delta rule for prefill, after HF ``torch_chunk_gated_delta_rule``.

    Same maths as T recurrent steps, organised in chunks of ``chunk`` rows: within a chunk the delta-rule
    corrections form a unit lower-triangular system solved once, and the state is carried between chunks.
    Returns (o [B,T,H,Dv] f32, S_T [B,H,Dk,Dv] f32). Not bit-identical to the recurrence (different order).
    """
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    q, k, v, g, beta = _f32(q, k, v, g, beta)
    pad = (-T) % chunk
    # [B,H,T,.] layout, padded with zeros: a padded step has k = 0, beta = 0, g = 0, so it changes nothing.
    tr = lambda a: jnp.pad(jnp.moveaxis(a, 1, 2), [(0, 0), (0, 0), (0, pad), (0, 0)])
    q, k, v = tr(q), tr(k), tr(v)
    g = jnp.pad(jnp.moveaxis(g, 1, 2), [(0, 0), (0, 0), (0, pad)])
    beta = jnp.pad(jnp.moveaxis(beta, 1, 2), [(0, 0), (0, 0), (0, pad)])
    n = (T + pad) // chunk
    ch = lambda a: a.reshape(B, H, n, chunk, *a.shape[3:])
    q, k, v, g, beta = ch(q), ch(k), ch(v), ch(g), ch(beta)
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    g = jnp.cumsum(g, axis=-1)  # within-chunk cumulative log decay
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    gdiff = g[..., :, None] - g[..., None, :]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, gdiff, 0.0)), 0.0)  # exp(g_i - g_j), i >= j
    hp = lax.Precision.HIGHEST
    L = jnp.where(strict, jnp.einsum("bhnid,bhnjd->bhnij", k_beta, k, precision=hp) * decay, 0.0)
    eye = jnp.eye(chunk, dtype=jnp.float32)
    A = jax.scipy.linalg.solve_triangular(eye + L, jnp.broadcast_to(eye, L.shape), lower=True, unit_diagonal=True)
    u = jnp.einsum("bhnij,bhnjd->bhnid", A, v_beta, precision=hp)
    w = jnp.einsum("bhnij,bhnjd->bhnid", A, k_beta * jnp.exp(g)[..., None], precision=hp)
    qk = jnp.where(lower, jnp.einsum("bhnid,bhnjd->bhnij", q, k, precision=hp) * decay, 0.0)

    def body(S, xs):
        qc, kc, uc, wc, gc, qkc = xs
        v_new = uc - jnp.einsum("bhik,bhkv->bhiv", wc, S, precision=hp)
        o = (jnp.einsum("bhik,bhkv->bhiv", qc * jnp.exp(gc)[..., None], S, precision=hp)
             + jnp.einsum("bhij,bhjv->bhiv", qkc, v_new, precision=hp))
        g_last = gc[..., -1]
        S = (S * jnp.exp(g_last)[..., None, None]
             + jnp.einsum("bhik,bhiv->bhkv", kc * jnp.exp(g_last[..., None] - gc)[..., None], v_new, precision=hp))
        return S, o

    xs = [jnp.moveaxis(a, 2, 0) for a in (q, k, u, w, g, qk)]
    S, o = lax.scan(body, S0.astype(jnp.float32), xs)  # o [n,B,H,chunk,Dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, H, n * chunk, Dv)[:, :, :T]
    return jnp.moveaxis(o, 1, 2), S
