"""The hybrid model layers on the Pallas kernel path, on the real weights of the tiny qwen4exp fixture
(``tests/fixtures/hybrid/qwen4exp_q8_0.gguf``: Q8_0 projections and experts, F32 router, F16 hyper-connection up).

A whole-model window in interpret mode compiles for minutes on a 2-core CPU, so the model is checked block by
block: layer 0 (hyper-connections + GDN mixer + MoE) and layer 3 (hyper-connections + QSA mixer + MoE), then the
head (output hyper-connection + vocabulary projection). Each block runs on the kernel path -- under
``STRATA_PALLAS_IMPL=interpret`` on CPU (every op's kernel in Pallas' interpreter where it can serve, the reference
where it cannot: the hyper-connection up projection has K = 8), ``auto`` (the compiled kernels) on a GPU -- and
under ``reference``:

(a) exactness on the kernel path: a window of B = 3 segments x T = 4 rows (12 rows: the quantized matmuls and the
    experts run as 8-row groups) gives, bit for bit, each segment's rows decoded alone (B = 1, T = 1 windows, each
    followed by commit(keep=1)); commit(keep) of the window gives the bits of keep single-row commits.
(b) the kernel path is close to the reference path: max |kernel - reference| <= 1e-5 * max |reference| for the
    block outputs and the logits. Why 1e-5: each op's kernel and its reference agree with a float64 product /
    recurrence to 1e-5 of the output's scale (the per-op tests in tests/pallas), the two paths differ only in
    summation order, and the differences do not grow through a block (measured on CPU: 1-3e-7 for both blocks and
    the logits).
The prefill path (the GDN chunked kernel, the experts in 8-row groups, QSA over prefill rows) is checked by (b) on
a 12-row chunk, at 1e-4 (the GDN chunked kernel and its reference both run the chunked WY algorithm, in different
summation orders, each within 1e-5 of float64).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from strata_jax.models.registry import config_from_gguf
from strata_jax.gguf.reader import open_gguf
from strata_jax.models.hybrid import HybridStage
from strata_jax.state import Rows

from pallas_testlib import assert_bits_equal

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "hybrid" / "qwen4exp_q8_0.gguf"
MC = 64                     # cells per slot
SLOTS = 3
POS0 = [29, 37, 42]         # > 16 cells: the QSA budget (4 blocks of 4) selects
REL_TOL = 1e-5          # kernel vs reference, windows and logits (module docstring)
PREFILL_TOL = 1e-4
# planar weights (the GPU; STRATA_PALLAS_IMPL=interpret at load) take the prefill GEMM at its default f16 products
# (gemm.DEFAULT_PRECISION, ~1e-4 of |x| @ |w| per GEMM): the block's chain of them measured 1.2e-4 .. 3.2e-4
# (interpret, 2026-12-07, fourth session); the GGUF-bytes kernel (CI) has no precision setting
PREFILL_TOL_F16 = 1e-3
KERNEL = "auto" if jax.default_backend() in ("gpu", "cuda", "rocm") else "interpret"


@functools.lru_cache(maxsize=1)
def _stage():
    if not FIX.exists():
        pytest.fail(f"committed fixture {FIX.name} is missing (experiments/parity/make_hybrid_fixtures.py makes it)")
    g = open_gguf(FIX)
    cfg = config_from_gguf(g)
    return cfg, HybridStage(g, cfg, 0, cfg.n_layer, scan=False)


class OnPath:
    """``fn`` jitted, traced with ``STRATA_PALLAS_IMPL=impl`` (the variable is read when a call is traced)."""

    def __init__(self, fn, impl: str):
        self.impl = impl
        self.f = jax.jit(lambda *a: fn(*a))  # a new function: its own trace cache

    def __call__(self, *args):
        old = os.environ.get("STRATA_PALLAS_IMPL")
        os.environ["STRATA_PALLAS_IMPL"] = self.impl
        try:
            return jax.block_until_ready(self.f(*args))
        finally:
            if old is None:
                os.environ.pop("STRATA_PALLAS_IMPL")
            else:
                os.environ["STRATA_PALLAS_IMPL"] = old


def _block_fns(blk, impl):
    gd, params = nnx.split(blk)

    def window(params, R, st, rows):
        return nnx.merge(gd, params)(R, st, rows, "window", MC)

    def prefill(params, R, st, rows):
        return nnx.merge(gd, params)(R, st, rows, "prefill", MC)[:2]

    def commit(params, st, pend, rows, keep):
        return nnx.merge(gd, params).commit(st, pend, rows, keep)

    return params, OnPath(window, impl), OnPath(prefill, impl), OnPath(commit, impl)


def _state(stage, i, rng):
    """Layer i's state for SLOTS slots: a random GDN state, or K/V and indexer-key caches holding random cells."""
    st = stage._layer_state(stage.blocks[i], SLOTS, MC, jnp.float32, None)
    fill = lambda a, s: jnp.asarray(rng.standard_normal(a.shape) * s, a.dtype)
    if stage.blocks[i].recurrent:
        st["mix"] = {"S": fill(st["mix"]["S"], 0.05), "conv": fill(st["mix"]["conv"], 1.0)}
    else:
        st["mix"] = tuple(fill(a, 1.0) for a in st["mix"])
    return st


def _rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def _take(tree, slot):
    return jax.tree.map(lambda a: a[slot:slot + 1], tree)


@pytest.mark.slow
@pytest.mark.parametrize("layer", [0, 3], ids=["gdn_block", "qsa_block"])
def test_block_window_exact_and_close(layer, rng):
    cfg, stage = _stage()
    blk = stage.blocks[layer]
    assert blk.recurrent == (layer == 0)
    st0 = _state(stage, layer, rng)
    T = 4
    R = jnp.asarray(rng.standard_normal((SLOTS, T, cfg.hc, cfg.n_embd)), jnp.float32)
    rows = Rows.make(list(range(SLOTS)), POS0, [T] * SLOTS)
    keep = jnp.asarray([1, 4, 2], jnp.int32)

    params, window, _, commit = _block_fns(blk, KERNEL)
    out, st_w, pend = window(params, R, st0, rows)
    st_c = commit(params, st_w, pend, rows, keep)

    # (a) each segment's rows decoded alone: B = 1, T = 1 windows, each committed (keep = 1)
    for b in range(SLOTS):
        st = st0
        for t in range(T):
            one = Rows.make([b], [POS0[b] + t], [1])
            o1, st, p1 = window(params, R[b:b + 1, t:t + 1], st, one)
            assert_bits_equal(o1[0, 0], out[b, t], f"layer {layer} slot {b} row {t}: window vs alone")
            st = commit(params, st, p1, one, jnp.ones((1,), jnp.int32))
            if blk.recurrent and t + 1 == int(keep[b]):  # (attention layers: commit has nothing to do)
                for got, want in zip(jax.tree.leaves(_take(st_c, b)), jax.tree.leaves(_take(st, b))):
                    assert_bits_equal(got, want, f"layer {layer} slot {b}: commit(keep={t + 1}) vs single commits")

    # (b) close to the reference path
    params_r, window_r, _, _ = _block_fns(blk, "reference")
    out_r, _, _ = window_r(params_r, R, st0, rows)
    assert np.all(np.isfinite(np.asarray(out)))
    assert _rel(out, out_r) <= REL_TOL, f"layer {layer}: kernel vs reference {_rel(out, out_r):.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("layer", [0, 3], ids=["gdn_block", "qsa_block"])
def test_block_prefill_close(layer, rng):
    """A 12-row prefill chunk of one slot: kernel path (GDN chunked kernel / QSA kernel over prefill rows, experts in
    8-row groups; the projections take the kernel GEMM for > 8 rows, planar weights at `PREFILL_TOL_F16`) vs the
    reference path."""
    from strata_jax.pallas.quant_matmul.api import precision
    cfg, stage = _stage()
    planar = any(getattr(a, "dtype", None) == jnp.uint32 for a in jax.tree.leaves(nnx.state(stage)))
    tol = PREFILL_TOL_F16 if planar and precision(True) == "f16" else PREFILL_TOL
    blk = stage.blocks[layer]
    st0 = _state(stage, layer, rng)
    n = 12
    R = jnp.asarray(rng.standard_normal((1, n, cfg.hc, cfg.n_embd)), jnp.float32)
    rows = Rows.make([1], [POS0[1]], [n - 2])  # two padding rows
    outs = {}
    for impl in (KERNEL, "reference"):
        params, _, prefill, _ = _block_fns(blk, impl)
        outs[impl] = prefill(params, R, st0, rows)
    (o_k, st_k), (o_r, st_r) = outs[KERNEL], outs["reference"]
    assert _rel(o_k[:, :n - 2], o_r[:, :n - 2]) <= tol
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(st_k), jax.tree.leaves(st_r)):
        if a.ndim >= 2 and a.shape[1] == MC + 1:  # per-slot cells: the last is where padding rows' writes land,
            a, b = a[:, :MC], b[:, :MC]           # never read (each path leaves its own values there)
        assert _rel(a, b) <= tol, _where(jax.tree_util.keystr(path), a, b, tol)


def _where(name, a, b, tol=PREFILL_TOL, show=6):
    """A state leaf's mismatch, located: its shape, the relative difference and the first indices past ``tol``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    bad = np.argwhere(np.abs(a - b) > tol * max(np.abs(b).max(), 1e-30))
    return (f"state leaf {name} {a.shape}: rel {_rel(a, b):.3g}, {len(bad)} elements past {tol:g}, first at "
            + ", ".join(f"{tuple(int(i) for i in ix)} ({a[tuple(ix)]:.4g} vs {b[tuple(ix)]:.4g})" for ix in bad[:show]))


@pytest.mark.slow
def test_head_rows_exact_and_close(rng):
    """The output hyper-connection + head (Q8_0 [512, 256]) for 12 rows (8-row groups) vs each row alone, and vs
    the reference."""
    cfg, stage = _stage()
    gd, params = nnx.split(stage)

    def head(params, R):
        st = nnx.merge(gd, params)
        return st.head(st.final_norm(R, True), True)

    R = jnp.asarray(rng.standard_normal((SLOTS, 4, cfg.hc, cfg.n_embd)), jnp.float32)
    k = OnPath(head, KERNEL)
    lg = k(params, R)
    for b, t in ((0, 0), (1, 3), (2, 1)):
        assert_bits_equal(k(params, R[b:b + 1, t:t + 1])[0, 0], lg[b, t], f"logits of row ({b}, {t}) alone")
    lg_r = OnPath(head, "reference")(params, R)
    assert _rel(lg, lg_r) <= REL_TOL
