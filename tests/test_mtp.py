"""MTP draft layers (`strata_jax.layers.mtp`) against a float64 numpy reference written from the spec.

HF transformers has no Qwen MTP module and llama.cpp's draft-mtp was not compiled here, so there is
no oracle: the tiny fixtures carry no MTP tensors. Each test writes a tiny GGUF (gguf.GGUFWriter, random weights)
holding an MTP block -- qwen35moe ``blk.{n_layer}.nextn.*`` + gated attention + MoE, and the qwen4exp layer under
this engine's naming convention -- and checks the JAX layer's logits and chained hidden against the numpy
reference (llama.cpp's ``graph_mtp``; the qwen4exp MTP cell of `strata_jax.layers.mtp`), over a prefill chunk
followed by a verify window, plus the window exactness (a T=3 window gives the bits of three T=1 windows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from strata_jax.gguf.reader import open_gguf
from strata_jax.layers.mtp import HCMTP, NextNMTP
from strata_jax.models.registry import config_from_gguf, mtp_head
from strata_jax.state import Rows

D, H, HKV, HD, RD, E, K, F, FS, V = 64, 4, 2, 16, 8, 4, 2, 16, 32, 96
HC, LR = 4, 8
EPS, THETA = 1e-6, 10000.0
MAX_CONTEXT = 16
N = 8  # MTP cells: positions 0..7


def _common_kv(w, arch, n_layer_total):
    p = arch + "."
    w.add_uint32(p + "block_count", n_layer_total)
    w.add_uint32(p + "nextn_predict_layers", 1)
    w.add_uint32(p + "embedding_length", D)
    w.add_uint32(p + "attention.head_count", H)
    w.add_uint32(p + "attention.head_count_kv", HKV)
    w.add_uint32(p + "attention.key_length", HD)
    w.add_uint32(p + "rope.dimension_count", RD)
    w.add_float32(p + "rope.freq_base", THETA)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", EPS)
    w.add_uint32(p + "ssm.time_step_rank", 2)
    w.add_uint32(p + "ssm.group_count", 1)
    w.add_uint32(p + "ssm.state_size", 8)
    w.add_uint32(p + "ssm.inner_size", 16)
    w.add_uint32(p + "expert_count", E)
    w.add_uint32(p + "expert_used_count", K)
    w.add_uint32(p + "vocab_size", V)


def _weights(rng, n):
    """Random block tensors (numpy order) for an MTP block under blk.n."""
    def r(*s, std=None):
        return (rng.standard_normal(s) * (std if std is not None else 1.0 / np.sqrt(s[-1]))).astype(np.float32)

    def nw(*s):
        return (1.0 + 0.2 * rng.standard_normal(s)).astype(np.float32)

    b = f"blk.{n}."
    t = {
        "token_embd.weight": r(V, D, std=1.0),
        "output.weight": r(V, D, std=2.0 / np.sqrt(D)),
        b + "attn_q.weight": r(H * 2 * HD, D), b + "attn_k.weight": r(HKV * HD, D),
        b + "attn_v.weight": r(HKV * HD, D), b + "attn_output.weight": r(D, H * HD),
        b + "attn_q_norm.weight": nw(HD), b + "attn_k_norm.weight": nw(HD),
        b + "ffn_gate_inp.weight": r(E, D, std=2.0 / np.sqrt(D)),
        b + "ffn_gate_exps.weight": r(E, F, D), b + "ffn_up_exps.weight": r(E, F, D),
        b + "ffn_down_exps.weight": r(E, D, F),
        b + "ffn_gate_shexp.weight": r(FS, D), b + "ffn_up_shexp.weight": r(FS, D),
        b + "ffn_down_shexp.weight": r(D, FS), b + "ffn_gate_inp_shexp.weight": r(D),
    }
    return t, r, nw


def _write(path, arch, tensors, extra_kv=None):
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    _common_kv(w, arch, 2)
    if extra_kv:
        extra_kv(w)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------------------- float64 reference

def _rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * (1.0 if w is None else w)


def _rope(x, pos):
    """x [N, heads, d], pos [N]: NeoX on the first RD dims."""
    inv = THETA ** (-np.arange(0, RD, 2, dtype=np.float64) / RD)
    ang = pos[:, None, None] * inv[None, None, :]
    a, b = x[..., :RD // 2], x[..., RD // 2:RD]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang), x[..., RD:]], -1)


def _attn(t, b, a, pos):
    """Gated attention of rows a [N, D] at positions pos (causal over these N cells)."""
    n = a.shape[0]
    qg = (a @ t[b + "attn_q.weight"].T).reshape(n, H, 2 * HD)
    q, gate = qg[..., :HD], qg[..., HD:]
    k = (a @ t[b + "attn_k.weight"].T).reshape(n, HKV, HD)
    v = (a @ t[b + "attn_v.weight"].T).reshape(n, HKV, HD)
    q, k = _rope(_rms(q, t[b + "attn_q_norm.weight"]), pos), _rope(_rms(k, t[b + "attn_k_norm.weight"]), pos)
    o = np.zeros((n, H, HD))
    for h in range(H):
        kh = h // (H // HKV)
        s = q[:, h] @ k[:, kh].T / np.sqrt(HD)
        s = np.where(pos[None, :] <= pos[:, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o[:, h] = p @ v[:, kh]
    o = o * (1 / (1 + np.exp(-gate)))
    return o.reshape(n, H * HD) @ t[b + "attn_output.weight"].T


def _moe(t, b, m):
    lg = m @ t[b + "ffn_gate_inp.weight"].T
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(m)
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    for i in range(m.shape[0]):
        ids = np.argsort(-p[i], kind="stable")[:K]
        w = p[i, ids] / max(p[i, ids].sum(), 2.0 ** -14)
        for wk, e in zip(w, ids):
            hg = t[b + "ffn_gate_exps.weight"][e] @ m[i]
            hu = t[b + "ffn_up_exps.weight"][e] @ m[i]
            out[i] += wk * (t[b + "ffn_down_exps.weight"][e] @ (silu(hg) * hu))
    gs, us = t[b + "ffn_gate_shexp.weight"] @ m.T, t[b + "ffn_up_shexp.weight"] @ m.T
    sh = t[b + "ffn_down_shexp.weight"] @ (silu(gs) * us)
    g = 1 / (1 + np.exp(-(m @ t[b + "ffn_gate_inp_shexp.weight"])))
    return out + g[:, None] * sh.T


def _nextn_ref(t, n, h, toks):
    b = f"blk.{n}."
    pos = np.arange(len(toks), dtype=np.float64)
    e = _rms(t["token_embd.weight"][toks], t[b + "nextn.enorm.weight"])
    x = np.concatenate([e, _rms(h, t[b + "nextn.hnorm.weight"])], -1) @ t[b + "nextn.eh_proj.weight"].T
    x = x + _attn(t, b, _rms(x, t[b + "attn_norm.weight"]), pos)
    x = x + _moe(t, b, _rms(x, t[b + "post_attention_norm.weight"]))
    nh = _rms(x, t[b + "nextn.shared_head_norm.weight"])
    return nh @ t["output.weight"].T, nh


def _gr(t, pre, R, inject=True):
    """Hyper-connection read of R [N, hc, D]."""
    n = R.shape[0]
    xn = _rms(R, None) * t[pre + "norm.weight"].reshape(HC, D)
    flat = xn.reshape(n, HC * D)
    lo = flat @ t[pre + "down.weight"].T / HC
    lo = lo / (1 + np.exp(-lo))
    m = 1 / (1 + np.exp(-(lo @ t[pre + "up.weight"].T)))
    mixed = (m.reshape(n, HC, D) * xn).mean(1)
    inj = 2 / (1 + np.exp(-(flat @ t[pre + "inject.weight"].T / HC))) if inject else None
    return mixed, inj


def _hc_ref(t, n, R, toks):
    b = f"blk.{n}."
    pos = np.arange(len(toks), dtype=np.float64)
    e = _rms(t["token_embd.weight"][toks], t[b + "nextn.enorm.weight"]) @ t[b + "nextn.fc_embedding.weight"].T
    hn = _rms(R.reshape(len(toks), HC * D), t[b + "nextn.hnorm.weight"]).reshape(len(toks), HC, D)
    R = hn @ t[b + "nextn.fc_hidden.weight"].T + e[:, None, :]
    mixed, inj = _gr(t, b + "hc_attn_", R)
    R = R + _attn(t, b, mixed, pos)[:, None, :] * inj[:, :, None]
    mixed, inj = _gr(t, b + "hc_ffn_", R)
    R = R + _moe(t, b, mixed)[:, None, :] * inj[:, :, None]
    mixed, _ = _gr(t, "output_hc_", R, inject=False)
    return mixed @ t["output.weight"].T, R


# ----------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def nextn_model(tmp_path_factory):
    rng = np.random.default_rng(7)
    n = 1  # one (absent) trunk layer, MTP block 1
    t, r, nw = _weights(rng, n)
    b = f"blk.{n}."
    t.update({
        "output_norm.weight": nw(D),
        b + "nextn.eh_proj.weight": r(D, 2 * D), b + "nextn.enorm.weight": nw(D), b + "nextn.hnorm.weight": nw(D),
        b + "nextn.shared_head_norm.weight": nw(D), b + "attn_norm.weight": nw(D),
        b + "post_attention_norm.weight": nw(D),
    })
    path = tmp_path_factory.mktemp("mtp") / "nextn.gguf"
    _write(path, "qwen35moe", t)
    g = open_gguf(path)
    cfg = config_from_gguf(g)
    return g, cfg, {k: v.astype(np.float64) for k, v in t.items()}, n


@pytest.fixture(scope="module")
def hc_model(tmp_path_factory):
    rng = np.random.default_rng(11)
    n = 1
    t, r, nw = _weights(rng, n)
    b = f"blk.{n}."
    for half in ("attn", "ffn"):
        t.update({b + f"hc_{half}_norm.weight": nw(HC * D), b + f"hc_{half}_down.weight": r(LR, HC * D),
                  b + f"hc_{half}_up.weight": r(HC * D, LR, std=1.0), b + f"hc_{half}_inject.weight": r(HC, HC * D)})
    t.update({"output_hc_norm.weight": nw(HC * D), "output_hc_down.weight": r(LR, HC * D),
              "output_hc_up.weight": r(HC * D, LR, std=1.0),
              b + "nextn.enorm.weight": nw(D), b + "nextn.hnorm.weight": nw(HC * D),
              b + "nextn.fc_embedding.weight": r(D, D), b + "nextn.fc_hidden.weight": r(D, D)})

    def kv(w):
        w.add_uint32("qwen4exp.hyper_connection.count", HC)
        w.add_uint32("qwen4exp.hyper_connection.low_rank", LR)
        w.add_uint32("qwen4exp.attention.indexer.head_count", 2)
        w.add_uint32("qwen4exp.attention.indexer.key_length", 8)
        w.add_uint32("qwen4exp.attention.indexer.top_k", 8)

    path = tmp_path_factory.mktemp("mtp") / "hc.gguf"
    _write(path, "qwen4exp", t, kv)
    g = open_gguf(path)
    cfg = config_from_gguf(g)
    return g, cfg, {k: v.astype(np.float64) for k, v in t.items()}, n


class _Jitted:
    """``draft`` of an MTP head under jax.jit (params as arguments; one compile per mode and shape)."""

    def __init__(self, head):
        gd, self.params = nnx.split(head)
        self.init_state = head.init_state

        @functools.partial(jax.jit, static_argnames=("mode",))
        def f(params, state, h, toks, rows, mode):
            return nnx.merge(gd, params).draft(state, h, toks, rows, mode)

        self._f = f

    def draft(self, state, h, toks, rows, mode="window"):
        return self._f(self.params, state, h, toks, rows, mode)


def _drive(head, h, toks, split):
    """Prefill rows [0, split), then one window of rows [split, N); returns logits and new_h of all rows."""
    state = head.init_state(1, MAX_CONTEXT)
    lg0, nh0, state = head.draft(state, jnp.asarray(h[None, :split], jnp.float32),
                                 jnp.asarray(toks[None, :split], jnp.int32), Rows.make([0], [0], [split]), "prefill")
    lg1, nh1, state = head.draft(state, jnp.asarray(h[None, split:], jnp.float32),
                                 jnp.asarray(toks[None, split:], jnp.int32), Rows.make([0], [split], [N - split]),
                                 "window")
    return (np.concatenate([np.asarray(lg0[0]), np.asarray(lg1[0])]),
            np.concatenate([np.asarray(nh0[0]), np.asarray(nh1[0])]), state)


def _rel(a, ref):
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def _window_exact(head, h, toks, split):
    """A T=3 window equals three T=1 windows bit for bit (after the same prefill)."""
    state = head.init_state(1, MAX_CONTEXT)
    _, _, state = head.draft(state, jnp.asarray(h[None, :split], jnp.float32),
                             jnp.asarray(toks[None, :split], jnp.int32), Rows.make([0], [0], [split]), "prefill")
    lw, hw, _ = head.draft(state, jnp.asarray(h[None, split:split + 3], jnp.float32),
                           jnp.asarray(toks[None, split:split + 3], jnp.int32), Rows.make([0], [split], [3]), "window")
    s = state
    for i in range(3):
        p = split + i
        l1, h1, s = head.draft(s, jnp.asarray(h[None, p:p + 1], jnp.float32),
                               jnp.asarray(toks[None, p:p + 1], jnp.int32), Rows.make([0], [p], [1]), "window")
        np.testing.assert_array_equal(np.asarray(l1[0, 0]), np.asarray(lw[0, i]))
        np.testing.assert_array_equal(np.asarray(h1[0, 0]), np.asarray(hw[0, i]))


def test_nextn_matches_reference(nextn_model):
    g, cfg, t, n = nextn_model
    assert cfg.n_layer == n and cfg.n_nextn == 1
    head = mtp_head(g, cfg)
    assert isinstance(head, NextNMTP)
    head = _Jitted(head)
    rng = np.random.default_rng(3)
    h = rng.standard_normal((N, D)).astype(np.float32)
    toks = rng.integers(0, V, N)
    ref_lg, ref_h = _nextn_ref(t, n, h.astype(np.float64), toks)
    lg, nh, _ = _drive(head, h, toks, 5)
    assert _rel(lg, ref_lg) < 1e-5
    assert _rel(nh, ref_h) < 1e-5
    _window_exact(head, h, toks, 4)


def test_nextn_chain(nextn_model):
    """Chained drafting: each step feeds its own new_h and argmax token at the next position; equals running the
    reference on the chained inputs."""
    g, cfg, t, n = nextn_model
    head = _Jitted(mtp_head(g, cfg))
    rng = np.random.default_rng(5)
    h0 = rng.standard_normal((1, D)).astype(np.float32)
    tok = int(rng.integers(0, V))
    state = head.init_state(1, MAX_CONTEXT)
    hs, toks = [h0[0]], [tok]
    h = jnp.asarray(h0[None], jnp.float32)
    for i in range(3):
        lg, h, state = head.draft(state, h, jnp.asarray([[tok]], jnp.int32), Rows.make([0], [i], [1]))
        tok = int(np.argmax(np.asarray(lg[0, -1])))
        if i < 2:
            hs.append(np.asarray(h[0, -1]))
            toks.append(tok)
    ref_lg, _ = _nextn_ref(t, n, np.stack(hs).astype(np.float64), np.array(toks))
    assert int(np.argmax(ref_lg[-1])) == tok


def test_qwen4exp_mtp_matches_reference(hc_model):
    g, cfg, t, n = hc_model
    head = mtp_head(g, cfg)
    assert isinstance(head, HCMTP)
    head = _Jitted(head)
    rng = np.random.default_rng(4)
    R = rng.standard_normal((N, HC, D)).astype(np.float32)
    toks = rng.integers(0, V, N)
    ref_lg, ref_R = _hc_ref(t, n, R.astype(np.float64), toks)
    lg, nR, _ = _drive(head, R, toks, 5)
    assert _rel(lg, ref_lg) < 1e-5
    assert _rel(nR, ref_R) < 1e-5
    _window_exact(head, R, toks, 4)
