"""Time XLA's lowering and compilation of one stage's jitted functions at a geometry's full-size shapes, without
building any weights (the stage module is built abstractly with `nnx.eval_shape`), to find which function, and
which Pallas kernel inside it, makes a compile slow (not a test).

Each (kernel selection, kind) pair compiles in its own subprocess under ``--timeout`` seconds (``--jobs`` at once),
so one slow compile is reported as such and the rest still run. Kernel selections (``--ops``): ``none`` (every op its plain-jnp
reference: ``STRATA_PALLAS_IMPL=reference``), ``all`` (``auto``), or one op-name prefix (``STRATA_PALLAS_OPS``,
see `strata_jax.pallas.dispatch`), e.g. ``grouped_experts``, ``qsa``, ``gdn``, ``quant_matmul``.

  python experiments/compile_probe.py --geometry qwen3.8-flash-next --n_layer 4 \
      --kinds prefill,step,window4 --ops none,all,grouped_experts,qsa,gdn,quant_matmul --out probe.json

``--lower_for cuda`` lowers for a GPU on any machine (no compile) with the kernel path forced, and lists the Pallas
kernels of each function with the size of their IR: a cheap check, on a CPU, of what a GPU compile will be given.
``--structure`` only traces each function on the kernel path (as on a GPU, on any machine) and reports its
structure (`strata_jax.pallas.structure.jaxpr_report`): Pallas calls and distinct kernels, XLA-level loops (while /
scan), optimization barriers, and the kernel operands XLA would copy on every call (slices or gathers of the weights
or the state, with their bytes). ``--stack 0|1`` sets ``STRATA_STACK_LAYERS`` (per-layer buffers or scanned stacks;
default: the engine's choice).

  python experiments/compile_probe.py --geometry qwen3.6-35b-a3b --n_layer 8 --kinds step --structure --stack 1

Kinds: ``prefill`` (one chunk of ``--prefill_chunk`` rows, default `PREFILL_CHUNK`, last-row logits), ``step``
(T = 1), ``windowT`` (a T-row verify window, all logits), ``mtp_prefill`` / ``mtp_windowT`` (the MTP layer's
catch-up + draft chain of ``--mtp`` drafts), ``stepsN`` / ``stepsNxB`` (`build_steps_fn`: N decode steps per
program over B slots, default 1, the whole model as one stage, the n-gram table on the device: the GPU's decode
loop, e.g. ``steps4x4`` for 4 slots).
Prints one line per pair: lower seconds, compile seconds (or ``timeout``), and the HLO size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _one(geometry: str, n_layer: int, kind: str, max_context: int, mtp: int, lower_for: str | None = None,
         structure: bool = False, profile_top: int = 0, prefill_chunk: int | None = None) -> dict:
    """Lower and compile one function in this process; returns timings. With ``lower_for`` (e.g. ``"cuda"``) the
    function is only lowered, for that platform (works on a CPU-only machine), with the kernel path forced, and the
    Pallas kernels it holds are listed with the size of their IR."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from strata_jax.models.registry import build_stage, config_from_gguf, mtp_head
    from strata_jax.testing.random_weights import VirtualGGUF, load_geometry
    from strata_jax.pipeline.engine import PREFILL_CHUNK, check_prefill_chunk
    from strata_jax.pipeline.stages import build_mtp_fn, build_stage_fn, make_stage
    from strata_jax.sampling import RowSampling, SamplingParams
    from strata_jax.state import Rows

    if lower_for or structure:  # the kernels' path as on a GPU, whatever this machine's backend is
        from strata_jax.pallas import dispatch

        dispatch.on_gpu = lambda: True
    triton_ir = []
    if lower_for:  # record the size of each kernel's Triton IR (ops, loads, loops) as Pallas lowers it
        from jax._src.pallas.triton import lowering as _tl

        orig_lower = _tl.lower_jaxpr_to_triton_module

        def lower_and_count(jaxpr, *a, **k):
            res = orig_lower(jaxpr, *a, **k)
            asm = res.module.operation.get_asm()
            name = jaxpr.debug_info.func_name if jaxpr.debug_info else "?"
            triton_ir.append({"kernel": name, "ops": asm.count(" = ") + asm.count("tt.store"),
                              "loads": asm.count("tt.load"), "dots": asm.count("tt.dot"),
                              "loops": asm.count("scf.for") + asm.count("scf.while")})
            return res

        _tl.lower_jaxpr_to_triton_module = lower_and_count
    if geometry.endswith(".gguf"):  # a real file: its header's shapes and formats (weights read lazily)
        from strata_jax.gguf.reader import open_gguf

        v = open_gguf(geometry)
    else:
        v = VirtualGGUF(load_geometry(geometry), n_layer=n_layer, mtp=kind.startswith("mtp"))
    cfg = config_from_gguf(v)
    samp = RowSampling.make([SamplingParams(0.0)])
    mode = "prefill" if kind.endswith("prefill") else "window"
    chunk = check_prefill_chunk(PREFILL_CHUNK if prefill_chunk is None else prefill_chunk, max_context)
    steps = re.fullmatch(r"steps(\d+)(?:x(\d+))?", kind)
    T = chunk if mode == "prefill" else (1 if kind == "step" or steps else int(kind.rsplit("window", 1)[1]))
    rows = Rows.make([0], [0], [T])
    t0 = time.perf_counter()
    if steps:  # the GPU's decode loop: n one-row steps per program over B slots (the whole model in one stage)
        from strata_jax.pipeline.stages import build_steps_fn

        n_steps, B = int(steps.group(1)), int(steps.group(2) or 1)
        mod = nnx.eval_shape(lambda: build_stage(v, cfg, 0, n_layer, None))
        st = make_stage(mod, 0, None)
        state = jax.eval_shape(lambda: mod.init_state(B, max_context))
        ids = ple = None
        if getattr(mod, "has_ple", False):  # the n-gram table on the device, as `Engine.run_steps` needs it
            from strata_jax.layers.ple import DeviceRowIds

            table = type(mod).ple_table(v, cfg)
            ids = DeviceRowIds(table, cfg.vocab_size)
            ple = {**ids.arrays, "raw": jax.ShapeDtypeStruct(table.raw.shape, jnp.uint8),
                   "prev": jax.ShapeDtypeStruct((B, table.context), jnp.int32)}
        fn = build_steps_fn(st, n_steps, max_context, ids)
        args = (st.leaves, state, jax.ShapeDtypeStruct((B, 1), jnp.int32), Rows.make(list(range(B)), [0] * B,
                [1] * B), RowSampling.make([SamplingParams(0.0)] * B), ple)
    elif kind.startswith("mtp"):
        head = nnx.eval_shape(lambda: mtp_head(v, cfg, None))
        gd, params = nnx.split(head)
        state = jax.eval_shape(lambda: head.init_state(1, max_context, jnp.float32, None))
        hc = int(getattr(cfg, "hc", 0) or 0)  # qwen4exp hands the MTP layer all hyper-connection streams
        h = jax.ShapeDtypeStruct((1, T, hc, cfg.n_embd) if hc > 1 else (1, T, cfg.n_embd), jnp.float32)
        nxt = jax.ShapeDtypeStruct((1, T), jnp.int32)
        n_use = jnp.asarray([T], jnp.int32)
        fn, args = build_mtp_fn(gd, mode, mtp), (params, state, h, nxt, rows, n_use)
    else:
        mod = nnx.eval_shape(lambda: build_stage(v, cfg, 0, n_layer, None))
        st = make_stage(mod, 0, None)
        state = jax.eval_shape(lambda: mod.init_state(1, max_context))
        toks = jax.ShapeDtypeStruct((1, T), jnp.int32)
        extra = None
        if getattr(mod, "has_ple", False):
            table = type(mod).ple_table(v, cfg)
            rb = table.gather(np.stack([table.start_prev()]), np.zeros((1, T), np.int64))
            extra = {"ple": jax.ShapeDtypeStruct(rb.shape, rb.dtype)}
        fn = build_stage_fn(st, "prefill" if mode == "prefill" else ("step" if kind == "step" else "window"),
                            max_context, "last" if mode == "prefill" else "all")
        args = (st.params, state, toks, rows, toks, samp, extra)
    if structure:
        from strata_jax.pallas import structure as S

        rep = S.jaxpr_report(fn.trace(*args).jaxpr, [len(jax.tree.leaves(a)) for a in args])
        by_arg = {}
        for o in rep.sliced_operands:
            k = {0: "weights", 1: "state"}.get(o["arg"], f"arg{o['arg']}")
            n, b = by_arg.get(k, (0, 0))
            by_arg[k] = (n + 1, b + o["bytes"])
        top = sorted(rep.sliced_operands, key=lambda o: -o["bytes"])[:5]
        return {"trace_s": round(time.perf_counter() - t0, 2), "structure": rep.summary(),
                "copies": {k: {"count": n, "bytes": b} for k, (n, b) in by_arg.items()},
                "largest_copies": [(o["kernel"], o["via"], list(o["shape"]), o["bytes"]) for o in top]}
    low = _lower(fn, lower_for, *args)
    t_lower = time.perf_counter() - t0
    text = low.as_text()
    if os.environ.get("STRATA_PROBE_DUMP"):  # the lowered module's text, for reading the glue between kernels
        with open(f"{os.environ['STRATA_PROBE_DUMP']}.{kind}.mlir", "w") as f:  # one file per kind (child)
            f.write(text)
    hlo_chars = len(text)
    if lower_for:
        kernels = [(m.group(1), len(line)) for line in text.splitlines() if "custom_call" in line
                   for m in [re.search(r'name = \\?"([^"\\]*)', line)] if m]
        return {"lower_s": round(t_lower, 2), "hlo_chars": hlo_chars, "platform": lower_for, "kernels": kernels,
                "triton_ir": triton_ir, "triton_calls": _triton_calls(text)}
    t0 = time.perf_counter()
    if profile_top:  # where XLA's compile spends its time: the host trace events of the compile, by name
        import tempfile

        from strata_jax.pallas import trace as T

        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                low.compile()
            compile_s = time.perf_counter() - t0
            by_name: dict[str, list[float]] = {}
            for e in T.load_events(d):
                if e.get("ph") == "X" and "dur" in e and not str(e.get("name", "")).startswith("$"):  # not Python
                    name = re.sub(r"\d+", "#", str(e.get("name", "?")))[:90]
                    by_name.setdefault(name, [0.0, 0])
                    by_name[name][0] += e["dur"] / 1e6
                    by_name[name][1] += 1
        top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:profile_top]
        return {"lower_s": round(t_lower, 2), "compile_s": round(compile_s, 2), "hlo_chars": hlo_chars,
                "backend": jax.default_backend(),
                "compile_events": [(n, round(s_, 2), c) for n, (s_, c) in top]}
    low.compile()
    return {"lower_s": round(t_lower, 2), "compile_s": round(time.perf_counter() - t0, 2), "hlo_chars": hlo_chars,
            "backend": jax.default_backend()}


def _braced(s: str, i: int) -> str:
    """The text of the ``{...}`` group opening at ``s[i]``, braces inside quoted strings (with backslash escapes)
    not counted."""
    depth, quoted, esc = 0, False, False
    for j in range(i, len(s)):
        c = s[j]
        if quoted:
            esc, quoted = (False, quoted) if esc else (c == "\\", c != '"')
        elif c == '"':
            quoted = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return s[i:j + 1]
    raise ValueError("unbalanced braces in a custom call's backend config")


def _triton_calls(text: str) -> dict:
    """The Triton custom calls of a lowered module's text: how many, how many distinct backend configs (XLA's GPU
    emitter compiles one kernel per distinct config: its kernel reuse cache is keyed by the config string, the
    Triton IR with its debug locations included) and how many distinct IR strings among them."""
    configs = []
    for m in re.finditer(r'custom_call @__gpu\$xla\.gpu\.triton\(', text):
        k = text.find("mhlo.backend_config = {", m.end())
        configs.append(_braced(text, text.index("{", k)))
    irs = [m.group(1) for c in configs for m in [re.search(r'ir = "((?:[^"\\]|\\.)*)"', c)] if m]
    return {"calls": len(configs), "distinct_configs": len(set(configs)), "distinct_irs": len(set(irs))}


def _lower(fn, platform, *args):
    return fn.trace(*args).lower(lowering_platforms=(platform,)) if platform else fn.lower(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="qwen3.8-flash-next", help="configs/geometries/<name>.json, or a "
                    ".gguf file (its shapes and formats; --n_layer of its layers)")
    ap.add_argument("--n_layer", type=int, default=4, help="trunk layers (one period of qwen4exp is 4)")
    ap.add_argument("--kinds", default="prefill,step,window4", help="comma list (see the module docstring)")
    ap.add_argument("--ops", default="none,all", help="comma list of kernel selections (see the module docstring)")
    ap.add_argument("--max_context", type=int, default=1024)
    ap.add_argument("--prefill_chunk", type=int, default=None, help="rows of the prefill kinds' chunk (the engine's "
                    "--prefill_chunk; default: its default)")
    ap.add_argument("--mtp", type=int, default=3, help="drafts in the MTP chain (mtp_* kinds)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per (selection, kind) subprocess")
    ap.add_argument("--lower_for", default=None, help="only lower, for this platform (e.g. cuda, on a CPU-only "
                    "machine), with the kernel path forced; lists the Pallas kernels and their IR size")
    ap.add_argument("--structure", action="store_true", help="only trace on the kernel path and report the program's "
                    "structure (loops, barriers, kernel operands copied from slices)")
    ap.add_argument("--stack", choices=("auto", "0", "1"), default="auto", help="STRATA_STACK_LAYERS for the "
                    "children: 1 = layers stacked into scans, 0 = one run per layer, auto = the engine's choice")
    ap.add_argument("--profile_top", type=int, default=0, help="trace each compile (jax.profiler) and report the N "
                    "host events (XLA passes, codegen, ptxas) that take the most time, by name (# = any number)")
    ap.add_argument("--xla_variants", default="", help="'|'-separated NAME=FLAGS sets, each appended to XLA_FLAGS "
                    "for its own run of every pair (e.g. 'base=|nocb=--xla_gpu_enable_command_buffer=')")
    ap.add_argument("--jobs", type=int, default=1, help="pairs compiled at once (each its own process)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        print(json.dumps(_one(args.geometry, args.n_layer, args._child, args.max_context, args.mtp, args.lower_for,
                              args.structure, args.profile_top, args.prefill_chunk)))
        return
    from strata_jax.pipeline.engine import PREFILL_CHUNK

    chunk = PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk  # recorded with each prefill kind
    variants = [v.split("=", 1) if "=" in v else (v, "") for v in args.xla_variants.split("|") if v] or [("", "")]
    pairs = [(ops + (f"/{vn}" if vn else ""), kind, vf) for vn, vf in variants for ops in args.ops.split(",") if ops
             for kind in args.kinds.split(",") if kind]
    print(f"{'ops':<16} {'kind':<14} {'lower s':>8} {'compile s':>10} {'HLO chars':>10}", flush=True)
    results = []

    def run_pair(pair):
        label, kind, xla_extra = pair
        ops = label.split("/")[0]
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # several children may share one GPU
        if xla_extra:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_extra).strip()
        env.pop("STRATA_PALLAS_OPS", None)
        env.pop("STRATA_STACK_LAYERS", None)
        if args.stack != "auto":
            env["STRATA_STACK_LAYERS"] = args.stack
        if args.lower_for or args.structure:
            env["STRATA_PALLAS_IMPL"] = "kernel"  # as on a GPU: every kernel that can serve the call
        elif ops == "none":
            env["STRATA_PALLAS_IMPL"] = "reference"
        else:
            env["STRATA_PALLAS_IMPL"] = "auto"
            if ops != "all":
                env["STRATA_PALLAS_OPS"] = ops
        cmd = [sys.executable, os.path.abspath(__file__), "--geometry", args.geometry, "--n_layer",
               str(args.n_layer), "--max_context", str(args.max_context), "--mtp", str(args.mtp), "--_child", kind]
        if args.lower_for:
            cmd += ["--lower_for", args.lower_for]
        if args.structure:
            cmd += ["--structure"]
        if args.profile_top:
            cmd += ["--profile_top", str(args.profile_top)]
        if args.prefill_chunk is not None:
            cmd += ["--prefill_chunk", str(args.prefill_chunk)]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            r = json.loads(lines[-1]) if p.returncode == 0 and lines else {
                "error": (p.stderr.strip().splitlines() or ["no output"])[-1][:200]}
        except subprocess.TimeoutExpired:
            r = {"timeout_s": args.timeout}
        ops = label
        r.update(ops=ops, kind=kind, xla_flags=xla_extra, prefill_chunk=chunk if kind.endswith("prefill") else None,
                 wall_s=round(time.perf_counter() - t0, 1))
        if "structure" in r:
            st = r["structure"]
            cp = ", ".join(f"{k} {v['count']} ({v['bytes'] / 1e6:.1f} MB)" for k, v in r["copies"].items()) or "none"
            print(f"{ops:<16} {kind:<14} {r['trace_s']:>8.1f} {'(traced)':>10} {'':>10}  {st['kernels']} Pallas calls "
                  f"({st['kernel_variants']} kernels), XLA while {st['xla_while']}, scan {st['xla_scan']}, barriers "
                  f"{st['barriers']}, kernel loops with traced bounds {st['kernel_while']}; copied kernel operands "
                  f"per call: {cp}", flush=True)
        elif "kernels" in r:
            print(f"{ops:<16} {kind:<14} {r['lower_s']:>8.1f} {'(lowered for ' + r['platform'] + ')':>10} "
                  f"{r['hlo_chars']:>10}  {len(r['kernels'])} kernels: "
                  + ", ".join(f"{n} {b // 1000} KB" for n, b in r["kernels"]), flush=True)
            ir = r.get("triton_ir") or []
            if ir:
                print(f"{'':<31} Triton IR: {sum(k['ops'] for k in ir)} ops, {sum(k['loads'] for k in ir)} loads in "
                      f"{len(ir)} kernels; largest: " + ", ".join(
                          f"{k['kernel']} {k['ops']} ops / {k['loads']} loads"
                          for k in sorted(ir, key=lambda k: -k["ops"])[:4]), flush=True)
        elif "compile_s" in r:
            print(f"{ops:<16} {kind:<14} {r['lower_s']:>8.1f} {r['compile_s']:>10.1f} {r['hlo_chars']:>10}",
                  flush=True)
            for n, secs, count in r.get("compile_events", []):
                print(f"{'':<31} {secs:8.2f} s {count:6d}x  {n}", flush=True)
        else:
            print(f"{ops:<16} {kind:<14} {'timeout' if 'timeout_s' in r else 'error':>8} "
                  f"{r.get('error', f'> {args.timeout:.0f} s')}", flush=True)
        results.append(r)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"geometry": args.geometry, "n_layer": args.n_layer, "results": results}, f, indent=1)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(run_pair, pairs))

if __name__ == "__main__":
    main()
