"""The structure of the GPU step program (issue 12 items 1-2), checked on a CPU with the tiny qwen4exp fixture
(``tests/fixtures/hybrid/qwen4exp_q8_0.gguf``: GDN, QSA and PLE layers, Q8_0 / F32 / F16 weights).

Three programs, as the engine builds them (`strata_jax.pipeline.stages.build_stage_fn`, two slots): a prefill chunk
(`PREFILL_CHUNK` rows, last-row logits), the one-row decode step (window + commit) and a T = 4 verify window.

(1) `test_kernel_path_programs` traces them on the kernel path exactly as on a GPU (``STRATA_PALLAS_IMPL=kernel``
    with the backend taken for a GPU: the Pallas calls are traced, not lowered) and walks the programs, kernel
    bodies included (`strata_jax.pallas.structure.jaxpr_report`): no loop at the XLA level at all (no ``while``,
    no ``scan`` -- neither the 8-row chunk loops, ``lax.map`` over rows, nor a layer scan), no
    ``optimization_barrier``, no loop with traced bounds inside a kernel, and no kernel operand that is a slice
    or gather of the weights or the state (XLA would copy it on every call). Cheap: tracing only.
(2) `test_step_hlo_loops_known` compiles them for this CPU with every kernel in Pallas' interpreter
    (``STRATA_PALLAS_IMPL=interpret``: the GPU program's structure) and reads the optimized HLO: every while loop
    has a trip count XLA knows (``known_trip_count``), so none would copy its predicate to the host on a GPU.
    The interpreter emulates each kernel's grid, and the kernels' own inner loops (fixed trip counts by design:
    K chunks per split, the GDN steps, QSA cells per split), as XLA while loops; those loops do not exist in the
    GPU program, where a kernel is one launch. The test therefore also requires every while loop to belong to a
    kernel (its JAX name stack names one of the program's Pallas kernels), except the sampler's random-bits loop
    (threefry, unrolled on GPU). Compiled at XLA's lowest backend optimisation level (the HLO passes that count
    trip counts still run) to keep the test's minute of compile down.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.gguf.reader import open_gguf
from strata_jax.models import build_stage, config_from_gguf
from strata_jax.pallas import dispatch, structure
from strata_jax.pipeline.engine import PREFILL_CHUNK
from strata_jax.pipeline.stages import build_stage_fn, make_stage
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "hybrid" / "qwen4exp_q8_0.gguf"
MC = 64
SLOTS = 2  # more than one slot: a gather of one slot's state would be a real copy
PROGRAMS = [("prefill", PREFILL_CHUNK), ("step", 1), ("window", 4)]
KERNEL_FAMILIES = ("qmatmul_", "gdn_scan", "gdn_chunk", "qsa_attend", "qsa_scores", "rows_")


def _programs(impl: str, monkeypatch):
    """[(kind, T, jitted fn, args)] of the fixture's one stage, built and traced with STRATA_PALLAS_IMPL=impl."""
    if not FIX.exists():
        pytest.fail(f"committed fixture {FIX.name} is missing (experiments/parity/make_hybrid_fixtures.py makes it)")
    monkeypatch.setenv("STRATA_PALLAS_IMPL", impl)
    monkeypatch.delenv("STRATA_PALLAS_OPS", raising=False)
    monkeypatch.delenv("STRATA_STACK_LAYERS", raising=False)
    if impl == "kernel":
        monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    g = open_gguf(FIX)
    cfg = config_from_gguf(g)
    mod = build_stage(g, cfg, 0, cfg.n_layer, None)
    stage = make_stage(mod, 0, None)
    state = mod.init_state(SLOTS, MC)
    table = type(mod).ple_table(g, cfg)
    samp = RowSampling.make([SamplingParams(0.0)])
    out = []
    for kind, T in PROGRAMS:
        rows = Rows.make([1], [3], [T])
        toks = jnp.asarray(np.arange(T, dtype=np.int32)[None] % cfg.vocab_size)
        ple = table.gather(np.stack([table.start_prev()]), np.asarray(toks))
        fn = build_stage_fn(stage, kind, MC, "last" if kind == "prefill" else "all")
        out.append((kind, T, fn, (stage.params, state, toks, rows, toks, samp, {"ple": jnp.asarray(ple)})))
    return out


def test_kernel_path_programs(monkeypatch):
    for kind, T, fn, args in _programs("kernel", monkeypatch):
        rep = structure.jaxpr_report(fn.trace(*args).jaxpr, [len(jax.tree.leaves(a)) for a in args])
        what = f"{kind} (T={T})"
        assert rep.kernels, f"{what}: no Pallas kernel on the kernel path"
        names = set(rep.kernels)
        gdn = ("gdn_chunk_prepare", "gdn_chunk_state", "gdn_chunk_output") if kind == "prefill" else ("gdn_scan",)
        # prefill: the rows path of qsa_prefill (STRATA_QSA_PREFILL's default), with its own split layout
        qsa = ("qsa_scores", "qsa_attend_rows_prefill") if kind == "prefill" else ("qsa_attend",)
        for fam in ("qmatmul_", *gdn, *qsa, "rows_rms_norm"):
            assert any(n.startswith(fam) for n in names), f"{what}: no {fam} kernel in {sorted(names)}"
        assert not rep.xla_while, f"{what}: XLA while loops (traced trip counts): {rep.xla_while}"
        assert not rep.xla_scan, f"{what}: XLA scans / maps of lengths {rep.xla_scan}"
        assert rep.barriers == 0, f"{what}: {rep.barriers} optimization barriers"
        assert not rep.kernel_while, f"{what}: kernel loops with traced bounds in {rep.kernel_while}"
        assert not rep.sliced_operands, f"{what}: kernel operands copied from slices: {rep.sliced_operands}"
        # the MoE router's top-k is a rows kernel with its softmax (rows.softmax_top_k; XLA:GPU ran jax.lax.top_k
        # as a sort and a slice); the top_k left is the QSA indexer's, one per attention layer
        n_att = sum(n.startswith("qsa_attend") for n in rep.kernels)
        assert rep.ops.get("top_k", 0) == n_att, f"{what}: {rep.ops.get('top_k', 0)} top_k, {n_att} QSA layers"
        assert "rows_softmax_top_k" in names and "rows_softmax" not in names, f"{what}: {sorted(names)}"
        # the GDN's q / k norms, scale and v-head repeat are one rows kernel (rows.qk_l2_norm), no l2 norm left
        assert "rows_qk_l2_norm" in names and "rows_l2_norm" not in names, f"{what}: {sorted(names)}"
        if kind != "prefill":  # window rows: the shared-expert gate's product, sum and sigmoid in one program
            assert "rows_dot_map" in names and "rows_sum_map" not in names, f"{what}: {sorted(names)}"
        if kind == "step":
            # one row: the routed experts' union is the row's own ids (grouped_experts.union_slots), no sort; the
            # only sort left is the QSA indexer's block selection, one per attention layer (XLA:GPU runs each as a
            # sort kernel: the Flash-Next steps HLO of 2026-12-04 had 48 + 12 of them per token from these two)
            n_att = sum(n == "qsa_attend" for n in rep.kernels)
            assert rep.ops.get("sort", 0) == n_att, f"{what}: {rep.ops.get('sort', 0)} sorts, {n_att} QSA layers"


@pytest.mark.slow
def test_step_hlo_loops_known(monkeypatch):
    opts = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    for kind, T, fn, args in _programs("interpret", monkeypatch):
        hlo = fn.lower(*args).compile(compiler_options=opts).as_text()
        loops = structure.hlo_while_loops(hlo)
        what = f"{kind} (T={T})"
        assert loops, f"{what}: no while loop at all (the interpreter's grid loops are expected)"
        unknown = [lp["op_name"] for lp in loops if lp["trip_count"] is None]
        assert not unknown, f"{what}: {len(unknown)} of {len(loops)} while loops without a known trip count: " \
                            f"{sorted(set(unknown))[:5]}"
        outside = [lp["op_name"] for lp in loops
                   if not any(f in lp["op_name"] for f in KERNEL_FAMILIES) and "threefry" not in lp["op_name"]
                   and "_uniform" not in lp["op_name"]]
        assert not outside, f"{what}: while loops outside the kernels: {sorted(set(outside))[:5]}"


_GPU_HLO = """HloModule jit_step, is_scheduled=true

%fused_add (param_0: f32[4], param_1: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  %param_1 = f32[4]{0} parameter(1)
  ROOT %add.1 = f32[4]{0} add(f32[4]{0} %param_0, f32[4]{0} %param_1)
}

%command_buffer (p: f32[4], p.1: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %p.1 = f32[4]{0} parameter(1)
  %loop_add_fusion = f32[4]{0} fusion(f32[4]{0} %p, f32[4]{0} %p.1), kind=kLoop, calls=%fused_add
  ROOT %custom-call.2 = f32[4]{0} custom-call(f32[4]{0} %loop_add_fusion), custom_call_target="__gpu$xla.gpu.triton"
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %t), index=1
  %custom-call.9 = f32[4]{0} custom-call(f32[4]{0} %x), custom_call_target="__gpu$xla.gpu.triton"
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %t), index=0
  ROOT %tuple = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %custom-call.9)
}

%cond (t.1: (s32[], f32[4])) -> pred[] {
  %t.1 = (s32[], f32[4]{0}) parameter(0)
  ROOT %lt = pred[] fusion((s32[], f32[4]{0}) %t.1), kind=kLoop, calls=%fused_add
}

ENTRY %main.5 (x.1: f32[4], y.1: f32[4]) -> f32[4] {
  %x.1 = f32[4]{0} parameter(0)
  %y.1 = f32[4]{0} parameter(1)
  %call = f32[4]{0} call(f32[4]{0} %x.1, f32[4]{0} %y.1), to_apply=%command_buffer
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %call), condition=%cond, body=%body
  ROOT %copy.3 = f32[4]{0} copy(f32[4]{0} %call)
}
"""


def test_hlo_launches_counts_graphs_and_loose_launches():
    """`structure.hlo_launches` on a hand-written final GPU module: a command buffer holding a fusion and a Triton
    call, a while loop (condition fusion + a Triton call in the body) and a copy outside; fusion bodies not
    walked."""
    got = structure.hlo_launches(_GPU_HLO)
    assert got == {"graphs": 1, "in_graphs": {"fusion": 1, "custom-call:__gpu$xla.gpu.triton": 1},
                   "outside": {"custom-call:__gpu$xla.gpu.triton": 1, "fusion": 1, "copy": 1}}


def test_hlo_launches_reads_xla_text():
    """On XLA's own text (this CPU's compile of a small function): no command buffers; the launches it lists are
    the module's fusions / ops, at least one."""
    hlo = jax.jit(lambda x, y: jnp.sin(x) @ y + 1.0).lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compile().as_text()
    got = structure.hlo_launches(hlo)
    assert got["graphs"] == 0 and not got["in_graphs"]
    assert sum(got["outside"].values()) >= 1, hlo


def _attr_inner(x):
    return jnp.sort(jnp.sin(x) * 3.0)


def _attr_body(i, x):
    return _attr_inner(x) + x[::-1]


def test_hlo_attribution_reads_stack_frames():
    """`structure.hlo_attribution` / `attribution_table` on this CPU's compile of a loop whose body sorts
    (XLA's own text with its stack-frame table): the loop body is walked, the sort is named ``sort`` and
    attributed to the line of `_attr_inner` that sorts, with its caller one frame out."""
    hlo = jax.jit(lambda x: jax.lax.fori_loop(0, 3, _attr_body, x)).lower(jnp.ones((8,))).compile().as_text()
    launches = structure.hlo_attribution(hlo)
    assert launches, hlo
    sorts = [r for r in launches if r["kind"] == "sort"]
    assert sorts, [r["kind"] for r in launches]
    fn_line = _attr_inner.__code__.co_firstlineno + 1
    f, line, func = sorts[0]["frames"][0]
    assert f.endswith("test_program_structure.py") and line == fn_line and func == "_attr_inner", sorts[0]
    assert sorts[0]["frames"][1][2] == "_attr_body", sorts[0]["frames"][:3]
    table = structure.attribution_table(launches, depth=2, under="tests/")
    src = f"pallas/test_program_structure.py:{fn_line} _attr_inner < pallas/test_program_structure.py:"
    assert any(k.startswith(src) and v.get("sort") for k, v in table.items()), table
