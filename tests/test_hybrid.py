"""Hybrid stages (qwen35moe, qwen3next, qwen4exp) against HF transformers reference logits, and window/commit
exactness.

Fixtures (``tests/fixtures/hybrid/``, made by ``experiments/parity/make_hybrid_fixtures.py``): ``<family>_f32.gguf``,
``<family>_q8_0.gguf``, ``<family>_ref.npz`` with ``prompt_ids`` [64], ``prefill_logits`` [64, V] (HF float32),
``step_ids`` [24] (step i feeds step_ids[i], yields step_logits[i]; step_ids[0] = argmax(prefill[-1])),
``step_logits`` [24, V], and ``oracle_q8_*`` (HF run on the dequantized Q8_0 weights, its own greedy ids).

The stage is driven as the engine does: one prefill chunk, then T=1 verify windows each followed by commit(keep=1).
For qwen4exp the driver also plays the host's PLE part: it gathers each window's table rows from the memory map
(`HybridStage.ple_table`) with the slot's committed predecessor tokens, and advances them by the kept tokens at
commit. The qwen4exp fixture has a QSA budget of 16 cells (4 blocks of 4), so the 64-token prompt and the decode
steps depend on the indexer's block selection (`test_qwen4exp_selection_matters`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from strata_jax.gguf.reader import open_gguf
from strata_jax.models.registry import build_stage, config_from_gguf
from strata_jax.models.hybrid import HybridStage
from strata_jax.state import Rows

FIX = Path(__file__).parent / "fixtures" / "hybrid"
FAMILIES = ("qwen3next", "qwen35moe", "qwen4exp")
MAX_CONTEXT = 128


def _need(path: Path):
    if not path.exists():
        pytest.fail(f"committed fixture {path.name} is missing (experiments/parity/make_hybrid_fixtures.py makes it)")


class Driver:
    """A stage with jitted forward / commit (params passed as arguments so the compile is reused)."""

    def __init__(self, gguf_path: Path, scan: bool = True):
        g = open_gguf(gguf_path)
        self.g = g
        self.cfg = config_from_gguf(g)
        # the engine's stage (scanned runs of identical periods), or the per-layer stage (scan=False)
        self.stage = (build_stage(g, self.cfg, 0, self.cfg.n_layer) if scan
                      else HybridStage(g, self.cfg, 0, self.cfg.n_layer, scan=False))
        self.table = HybridStage.ple_table(g, self.cfg) if self.stage.has_ple else None
        self.prev = {}  # slot -> committed PLE predecessors (host side)
        self._last = None  # (slot, ids) of the last window, for the host PLE advance at commit
        gd, self.params = nnx.split(self.stage)

        @functools.partial(jax.jit, static_argnames=("mode",))
        def fwd(params, state, x, rows, mode, ple):
            return nnx.merge(gd, params)(state, x, rows, mode, MAX_CONTEXT, ple=ple)

        @jax.jit
        def commit(params, state, pending, rows, keep):
            return nnx.merge(gd, params).commit(state, pending, rows, keep)

        self._fwd, self._commit = fwd, commit

    def init(self, n_slots=1):
        return self.stage.init_state(n_slots, MAX_CONTEXT)

    def _ple(self, ids, slot, start: bool):
        if self.table is None:
            return None
        prev = self.table.start_prev() if start else self.prev[slot]
        return jnp.asarray(self.table.gather(prev[None], np.asarray(ids)[None]))

    def prefill(self, state, ids, slot=0):
        rows = Rows.make([slot], [0], [len(ids)])
        ple = self._ple(ids, slot, True)
        out, state, _ = self._fwd(self.params, state, jnp.asarray(np.asarray(ids)[None], jnp.int32), rows, "prefill",
                                  ple)
        if self.table is not None:
            self.prev[slot] = self.table.advance(self.table.start_prev(), ids, len(ids))
        return np.asarray(out["logits"][0]), state

    def window(self, state, ids, pos, slot=0, prev=None):
        rows = Rows.make([slot], [pos], [len(ids)])
        if prev is not None:
            self.prev[slot] = prev
        ple = self._ple(ids, slot, False)
        out, state, pend = self._fwd(self.params, state, jnp.asarray(np.asarray(ids)[None], jnp.int32), rows,
                                     "window", ple)
        self._last = (slot, list(ids))
        return np.asarray(out["logits"][0]), state, pend, rows

    def commit(self, state, pend, rows, keep):
        if self.table is not None:
            slot, ids = self._last
            self.prev[slot] = self.table.advance(self.prev[slot], ids, keep)
        return self._commit(self.params, state, pend, rows, jnp.asarray([keep], jnp.int32))

    def decode(self, state, ids, pos0):
        """T=1 windows + commit(1) for each id; returns logits [n, V] and the state."""
        out = []
        for i, t in enumerate(ids):
            lg, state, pend, rows = self.window(state, [t], pos0 + i)
            state = self.commit(state, pend, rows, 1)
            out.append(lg[0])
        return np.stack(out), state


@functools.lru_cache(maxsize=None)
def _driver(family: str, quant: str, scan: bool = True) -> Driver:
    return Driver(FIX / f"{family}_{quant}.gguf", scan)


def _rel(a, ref):
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def _run_reference_drive(d: Driver, ref, step_ids):
    state = d.init()
    pre, state = d.prefill(state, ref["prompt_ids"])
    steps, _ = d.decode(state, step_ids, len(ref["prompt_ids"]))
    return pre, steps


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_matches_hf(family):
    _need(FIX / f"{family}_f32.gguf")
    ref = np.load(FIX / f"{family}_ref.npz")
    d = _driver(family, "f32")
    pre, steps = _run_reference_drive(d, ref, ref["step_ids"])
    assert _rel(pre, ref["prefill_logits"]) < 1e-4
    for i in range(len(steps)):
        assert _rel(steps[i], ref["step_logits"][i]) < 1e-4, f"step {i}"
    greedy = np.concatenate([[pre[-1].argmax()], steps[:-1].argmax(-1)])
    np.testing.assert_array_equal(greedy, ref["step_ids"])
    assert steps[-1].argmax() == ref["step_logits"][-1].argmax()


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_matches_oracle(family):
    _need(FIX / f"{family}_q8_0.gguf")
    ref = np.load(FIX / f"{family}_ref.npz")
    d = _driver(family, "q8_0")
    pre, steps = _run_reference_drive(d, ref, ref["oracle_q8_step_ids"])
    assert _rel(pre, ref["oracle_q8_prefill_logits"]) < 1e-3
    for i in range(len(steps)):
        assert _rel(steps[i], ref["oracle_q8_step_logits"][i]) < 1e-3, f"step {i}"
    greedy = np.concatenate([[pre[-1].argmax()], steps[:-1].argmax(-1)])
    np.testing.assert_array_equal(greedy, ref["oracle_q8_step_ids"])


@pytest.mark.parametrize("family", FAMILIES)
def test_precise_projections(family):
    """The prefill GEMMs that keep bf16x2 (`QLinear.precise`) are exactly the GDN layers' q/k/v projections."""
    from strata_jax.layers.gdn import GatedDeltaNet
    from strata_jax.layers.linear import QLinear
    stage = _driver(family, "q8_0").stage
    nodes = [n for _, n in nnx.iter_graph(stage)]
    qkv = {id(n.wqkv) for n in nodes if isinstance(n, GatedDeltaNet)}
    precise = {id(n) for n in nodes if isinstance(n, QLinear) and n.precise}
    assert qkv and precise == qkv


@pytest.mark.parametrize("family", FAMILIES)
def test_window_exact_and_commit(family):
    """A T=4 window holding the greedy ids gives the bits of four T=1 steps; commit(keep=2) then decoding
    continues with the bits of the T=1 path."""
    _need(FIX / f"{family}_f32.gguf")
    ref = np.load(FIX / f"{family}_ref.npz")
    d = _driver(family, "f32")
    P = len(ref["prompt_ids"])
    ids = [int(t) for t in ref["step_ids"][:7]]
    state0 = d.init()
    _, state0 = d.prefill(state0, ref["prompt_ids"])
    prev0 = d.prev.get(0)
    serial, _ = d.decode(state0, ids, P)  # 7 T=1 steps

    win, state, pend, rows = d.window(state0, ids[:4], P, prev=prev0)
    np.testing.assert_array_equal(win, serial[:4])
    picks = win.argmax(-1)
    np.testing.assert_array_equal(picks[:3], ids[1:4])  # the proposals are the greedy ids: all accepted
    state = d.commit(state, pend, rows, 2)
    cont, _ = d.decode(state, ids[2:], P + 2)
    np.testing.assert_array_equal(cont, serial[2:])


@pytest.mark.parametrize("family", FAMILIES)
def test_scan_equals_unrolled(family):
    """The scanned stage (runs of identical periods) computes what the per-layer stage computes: prefill logits,
    then a T=4 window and its commit(keep=2), then a T=1 window. Both run jitted, in the shapes the tests above
    compile (so the scanned stage reuses their functions)."""
    _need(FIX / f"{family}_f32.gguf")
    ref = np.load(FIX / f"{family}_ref.npz")
    d, flat = _driver(family, "f32"), _driver(family, "f32", scan=False)
    assert d.stage.scan and not flat.stage.scan
    P = len(ref["prompt_ids"])
    ids = [int(t) for t in ref["step_ids"][:4]]
    outs = []
    for drv in (d, flat):
        pre, s = drv.prefill(drv.init(), ref["prompt_ids"])
        win, s, pend, rows = drv.window(s, ids, P)
        s = drv.commit(s, pend, rows, 2)
        nxt, _, _, _ = drv.window(s, ids[2:3], P + 2)
        outs.append([pre, win, nxt])
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


def test_qwen4exp_selection_matters():
    """The qwen4exp fixture's QSA budget (16 cells) is below the prompt length: attending every cell instead of the
    indexer's selection moves the prefill logits far beyond the parity tolerance (so the parity test above checks
    the block selection)."""
    _need(FIX / "qwen4exp_f32.gguf")
    ref = np.load(FIX / "qwen4exp_ref.npz")
    d = _driver("qwen4exp", "f32", scan=False)
    stage = d.stage
    idx = [b.mixer.indexer for b in stage.blocks if not b.recurrent and b.mixer.indexer is not None]
    assert idx and idx[0].n_top * idx[0].ratio < len(ref["prompt_ids"])
    saved = idx[0].n_top
    try:
        idx[0].n_top = MAX_CONTEXT // idx[0].ratio  # every complete block of the context
        gd, params = nnx.split(stage)  # n_top is static: a graph of its own, jitted once
        rows = Rows.make([0], [0], [len(ref["prompt_ids"])])
        ple = d._ple(ref["prompt_ids"], 0, True)
        fwd = jax.jit(lambda p, st, x, r, pl: nnx.merge(gd, p)(st, x, r, "prefill", MAX_CONTEXT, ple=pl)[0])
        out = fwd(params, stage.init_state(1, MAX_CONTEXT), jnp.asarray(ref["prompt_ids"][None], jnp.int32), rows,
                  ple)
    finally:
        idx[0].n_top = saved
    assert _rel(np.asarray(out["logits"][0]), ref["prefill_logits"]) > 1e-2


def test_qwen4exp_ple_row_ids_match_hf():
    """The host-side PLE row ids of the prompt (from the GGUF's ple.* keys) equal HF's ``ngram_embedding`` input."""
    _need(FIX / "qwen4exp_f32.gguf")
    ref = np.load(FIX / "qwen4exp_ref.npz")
    if "ple_row_ids" not in ref:
        pytest.fail("fixture lacks ple_row_ids: regenerate it with experiments/parity/make_hybrid_fixtures.py")
    g = open_gguf(FIX / "qwen4exp_f32.gguf")
    cfg = config_from_gguf(g)
    tab = HybridStage.ple_table(g, cfg)
    ids = ref["prompt_ids"]
    np.testing.assert_array_equal(tab.row_ids(tab.start_prev(), ids), ref["ple_row_ids"])
    # chunked as the engine feeds it (prefill part, then windows), with the predecessors carried on the host
    a = tab.row_ids(tab.start_prev(), ids[:37])
    b = tab.row_ids(tab.advance(tab.start_prev(), ids[:37], 37), ids[37:])
    np.testing.assert_array_equal(np.concatenate([a, b]), ref["ple_row_ids"])


def test_qwen4exp_ple_gather_from_a_device_table():
    """`PLETable.gather` from a table held as a device array (random weights made on the device) returns the
    memory map's rows, gathered on the device (a jax.Array: nothing read back), for two segments of 5 tokens."""
    _need(FIX / "qwen4exp_q8_0.gguf")
    g = open_gguf(FIX / "qwen4exp_q8_0.gguf")
    tab = HybridStage.ple_table(g, config_from_gguf(g))
    rng = np.random.default_rng(7)
    prev = np.stack([tab.start_prev(), rng.integers(0, 200, tab.start_prev().shape)])
    toks = rng.integers(0, 200, (2, 5))
    host = tab.gather(prev, toks)
    assert isinstance(host, np.ndarray) and host.dtype == np.uint8 and host.shape[:2] == (2, 5)
    tab.raw = jnp.asarray(tab.raw)
    dev = tab.gather(prev, toks)
    assert isinstance(dev, jax.Array) and dev.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(dev), host)


def test_qwen4exp_qsa_selection_matches_hf():
    """The indexer's per-query cell selection in prefill equals HF's selected-token mask for the prompt."""
    _need(FIX / "qwen4exp_f32.gguf")
    ref = np.load(FIX / "qwen4exp_ref.npz")
    if "qsa_selected_mask" not in ref:
        pytest.fail("fixture lacks qsa_selected_mask: regenerate it with experiments/parity/make_hybrid_fixtures.py")
    d = _driver("qwen4exp", "f32")
    cfg = d.cfg
    L = [i for i in range(cfg.n_layer) if not cfg.layer_recurrent[i]][0]
    g = d.g
    front = HybridStage(g, cfg, 0, L)
    blk = HybridStage(g, cfg, L, L + 1, scan=False).blocks[0]
    ids = ref["prompt_ids"]
    T = len(ids)
    rows = Rows.make([0], [0], [T])
    ple = d._ple(ids, 0, True)
    out, _, _ = front(front.init_state(1, MAX_CONTEXT), jnp.asarray(ids[None], jnp.int32), rows, "prefill",
                      MAX_CONTEXT, ple=ple)
    mixed, _ = blk.hc_attn(out["hidden"], False)
    idx = blk.mixer.indexer
    pos = rows.positions(T)
    q, raw = idx.project(mixed, pos, False)
    cache = jnp.zeros((1, MAX_CONTEXT + 1, idx.hd), jnp.float32).at[0, :T].set(raw[0])
    mask = np.asarray(idx.cell_mask(q, idx.pooled(cache, MAX_CONTEXT), pos, MAX_CONTEXT + 1))[0, :, :T]
    want = np.asarray(ref["qsa_selected_mask"]).astype(bool) & np.tril(np.ones((T, T), bool))
    np.testing.assert_array_equal(mask, want)
