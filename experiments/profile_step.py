"""Profile the engine's decode step (not a test): wall ms per step, device busy fraction, kernel launches per step,
host<->device and device-to-device copies per step (count and bytes), the top kernels -- from a `jax.profiler`
trace of ``--steps`` steps (`strata_jax.pallas.trace.summarize`). (The step program's structure -- XLA loops,
kernel operands copied from slices -- is `compile_probe.py --structure`.)

  python experiments/profile_step.py --random_from experiments/data/qwen2.5-coder-1.5b.header.xz --out p.json
  python experiments/profile_step.py --model tests/fixtures/hybrid/qwen4exp_q8_0.gguf --steps 3   # CPU plumbing
  STRATA_PALLAS_IMPL=reference python experiments/profile_step.py ...    # the XLA-only path, for comparison

Steps are launched back to back with the picks left on the device (as `bench_decode.py` does); the wall time is
measured untraced first, then the same number of steps is traced. ``--command_buffers 0`` (the default for a
profile) launches every kernel alone so the trace shows each; ``1`` records them into CUDA graphs
(`strata_jax.pallas.gpu_flags`), for the wall time users see. ``--kind steps`` runs ``--decode_steps`` steps per program (`Engine.run_steps`, the GPU's default decode loop) and
gives every figure per token. On a CPU the trace's XLA executor events stand in
for kernels and there are no copies: the run checks the plumbing, not the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # after PYTHONPATH: a strata_jax given there (another version) wins


def parse_ab(spec: str) -> list[tuple[str, dict]]:
    """``--ab``'s 'NAME:VAR=V,VAR=V;NAME2:...' -> [("base", {}), (NAME, {VAR: V}), ...].

    Raises:
      SystemExit: a part without ``NAME:``, a setting without ``=``, a variable not named ``STRATA_*``, a name used
        twice (``base`` included)."""
    variants = [("base", {})]
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, colon, sets = part.partition(":")
        name = name.strip()
        if not colon or not name:
            raise SystemExit(f"profile_step: --ab part {part!r} is not NAME:VAR=V[,VAR=V]")
        if name in dict(variants):
            raise SystemExit(f"profile_step: --ab variant name {name!r} is used twice (or is 'base')")
        env = {}
        for kv in filter(None, (s.strip() for s in sets.split(","))):
            k, eq, v = kv.partition("=")
            if not eq or not k.strip().startswith("STRATA_"):
                raise SystemExit(f"profile_step: --ab setting {kv!r} of {name!r} is not STRATA_VAR=VALUE")
            env[k.strip()] = v.strip()
        variants.append((name, env))
    return variants


def _ab(args, eng, run, pos: int, per: int) -> None:
    """``--ab``: every variant's program traced and compiled again (its variables set, the engine's compile cache
    and JAX's in-memory caches cleared; a persistent compilation cache, e.g. ``JAX_COMPILATION_CACHE_DIR``, still
    serves a program it holds, so "first call" is a compile only when it missed), ``--warmup`` programs, then
    ``--steps`` timed, every variant from the same position; rounds alternate the variants, the order reversed on
    odd rounds. Prints one line per variant (ms per token of each round, the mean, the ratio to base); JSON in
    ``--out``."""
    import jax

    variants = parse_ab(args.ab)
    base_env = {k: os.environ.get(k) for _, v in variants for k in v}
    ms = {name: [] for name, _ in variants}
    compile_s = {name: [] for name, _ in variants}
    for r in range(args.ab_rounds):
        for name, sets in (variants if r % 2 == 0 else variants[::-1]):
            at = pos
            for k, v in base_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            os.environ.update(sets)
            eng.cache.clear()
            jax.clear_caches()
            t0 = time.perf_counter()
            run(1, at)
            compile_s[name].append(time.perf_counter() - t0)
            at += per
            run(args.warmup, at)
            at += args.warmup * per
            t0 = time.perf_counter()
            run(args.steps, at)
            ms[name].append((time.perf_counter() - t0) / args.steps / per * 1e3)
            at += args.steps * per
            print(f"round {r} {name:12s} {ms[name][-1]:7.3f} ms/token (first call {compile_s[name][-1]:.1f} s)",
                  flush=True)
    mean = {n: sum(v) / len(v) for n, v in ms.items()}
    print(f"{'variant':12s} {'ms/token by round':>30s} {'mean':>8s} {'vs base':>8s}  settings")
    for name, sets in variants:
        print(f"{name:12s} {' '.join(f'{x:.3f}' for x in ms[name]):>30s} {mean[name]:8.3f} "
              f"{mean[name] / mean['base']:8.3f}  {sets or '(as started)'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.random_from or args.geometry or args.model, "kind": args.kind,
                       "device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
                       "jax": jax.__version__, "decode_steps": per, "steps": args.steps, "warmup": args.warmup,
                       "max_context": args.max_context, "prompt_tokens": args.prompt_tokens,
                       "xla_flags": os.environ.get("XLA_FLAGS", ""),
                       "variants": {n: {"settings": s, "ms_per_token": ms[n], "first_call_s": compile_s[n]}
                                    for n, s in variants}}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a GGUF file (or a registry name)")
    src.add_argument("--random_from", help="a header file (python -m strata_jax.testing.random_gguf header): random "
                     "blocks of its shapes")
    src.add_argument("--geometry", help="configs/geometries/<name>.json: random weights made on the device")
    ap.add_argument("--n_layer", type=int, default=None, help="with --geometry: trunk layers")
    ap.add_argument("--kind", default="step", help="step (T = 1, window + commit), steps (--decode_steps one-row "
                    "steps per program, Engine.run_steps: figures per token), windowT (a T-row verify window) or "
                    "prefill (one prompt chunk of the engine's prefill_chunk rows, last-row logits)")
    ap.add_argument("--decode_steps", type=int, default=4, help="with --kind steps: steps per program")
    ap.add_argument("--ple_table", default="auto", choices=("auto", "host", "device"),
                    help="qwen4exp's n-gram table (Engine ple_table; --kind steps needs it on the device)")
    ap.add_argument("--top", type=int, default=10, help="kernels listed in the JSON's top_kernels")
    ap.add_argument("--hlo_out", default=None, help="also write the compiled program's HLO text here (the fusions "
                    "the trace names)")
    ap.add_argument("--steps", type=int, default=20, help="steps timed and traced")
    ap.add_argument("--warmup", type=int, default=3, help="steps run first (the first compiles)")
    ap.add_argument("--prompt_tokens", type=int, default=32)
    ap.add_argument("--max_context", type=int, default=1024)
    ap.add_argument("--prefill_chunk", type=int, default=None, help="with --kind prefill: rows per chunk (Engine "
                    "prefill_chunk; default the engine's: 512 on a GPU whose context holds them)")
    ap.add_argument("--command_buffers", type=int, choices=(0, 1), default=0, help="XLA command buffers (GPU)")
    ap.add_argument("--graphs_in_trace", type=int, choices=(0, 1), default=0, help="with --command_buffers 1: "
                    "keep the CUDA graphs while tracing (--xla_enable_command_buffers_during_profiling; XLA "
                    "otherwise turns them off inside a trace): the trace then shows the step as users run it")
    ap.add_argument("--hlo_launches", type=int, choices=(0, 1), default=1, help="report where the compiled "
                    "program's launches sit: in command buffers or alone (strata_jax.pallas.structure.hlo_launches)")
    ap.add_argument("--autotune", default="off", help="off | cache:DIR | default (strata_jax.pallas.gpu_flags)")
    ap.add_argument("--ab", default=None, help="instead of the trace: A/B variants of STRATA_* variables read at "
                    "trace time, on this one engine: 'NAME:VAR=V,VAR=V;NAME2:...' (the base, as started, is 'base'); "
                    "--ab_rounds rounds alternate the variants, each recompiled, then --warmup and --steps programs "
                    "timed (wall per token, command buffers as --command_buffers)")
    ap.add_argument("--ab_rounds", type=int, default=2)
    ap.add_argument("--trace_dir", default=None, help="keep the trace here (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    if args.ab:
        parse_ab(args.ab)  # a bad spec fails before anything loads

    from strata_jax.pallas import gpu_flags

    flags = gpu_flags.xla_flags(bool(args.command_buffers), args.autotune)
    if args.command_buffers and args.graphs_in_trace:
        flags.append("--xla_enable_command_buffers_during_profiling=true")
    gpu_flags.apply(flags)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from strata_jax.pallas import dispatch, trace
    from strata_jax.pipeline.engine import Engine
    from strata_jax.sampling import RowSampling, SamplingParams
    from strata_jax.state import Rows

    if args.random_from:
        from strata_jax.testing import random_gguf

        path = os.path.join(tempfile.gettempdir(), "strata_profile_random.gguf")
        random_gguf.fill(args.random_from, path)
        model = path
    elif args.geometry:
        from strata_jax.testing.random_weights import VirtualGGUF, load_geometry

        model = VirtualGGUF(load_geometry(args.geometry), n_layer=args.n_layer)
    else:
        from strata_jax.models_registry import resolve_model

        model = str(resolve_model(args.model))
    t0 = time.perf_counter()
    eng = Engine(model, max_context=args.max_context, ple_table=args.ple_table, prefill_chunk=args.prefill_chunk)
    load_s = time.perf_counter() - t0
    if args.kind == "prefill":
        T, kind = eng.prefill_chunk, "prefill"
    elif args.kind == "steps":
        T, kind = 1, "steps"
    else:
        T = 1 if args.kind == "step" else int(args.kind.removeprefix("window"))
        kind = "step" if T == 1 else "window"
    # the cells the run writes (see `run` below): one-row programs advance one position per token through the
    # first call, the warm-up and the timed and traced runs; a window / prefill chunk re-reads its T rows from the
    # start each run() call was given (which advances by 1, warmup and steps)
    per = args.decode_steps if kind == "steps" else 1  # tokens per program
    if args.ab:
        if T != 1:
            raise SystemExit("profile_step: --ab times one-row programs (--kind step or steps)")
        if args.ab_rounds < 1 or args.steps < 1:
            raise SystemExit("profile_step: --ab needs --ab_rounds and --steps of at least 1")
        furthest = args.prompt_tokens + per * (1 + args.warmup + args.steps)  # each variant from the same position
    elif T == 1:
        furthest = args.prompt_tokens + per * (1 + args.warmup + 2 * args.steps)
    else:
        furthest = args.prompt_tokens + 1 + args.warmup + args.steps + T
    if furthest > args.max_context:
        raise SystemExit(f"profile_step: --max_context {args.max_context} is too short for {args.kind}: the run "
                         f"writes {furthest} cells (prompt {args.prompt_tokens}, then {T} rows per call); raise "
                         "--max_context or lower --steps / --prefill_chunk")
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, min(eng.cfg.vocab_size, 30000), args.prompt_tokens).tolist()
    sp = SamplingParams(0.0)
    first, _ = eng.prefill(0, prompt, sp)
    samp = RowSampling.make([sp])
    pos = len(prompt)
    toks = np.asarray(rng.integers(100, min(eng.cfg.vocab_size, 30000), (1, T)), np.int32)
    toks[0, 0] = first
    tok = jnp.asarray(toks)

    dispatched = []

    def run(n, start):
        """n programs back to back from position ``start`` (a window re-verifies the same positions); records the
        host's time to launch them (before waiting) in ``dispatched``."""
        nonlocal tok
        out = None
        t = time.perf_counter()
        for i in range(n):
            if kind == "steps":
                out = eng.run_steps(tok, Rows.make([0], [start + i * per], [1]), samp, per)
                tok = out["last"]
                continue
            p = start + i if T == 1 else start
            out, _ = eng.run(kind, tok, Rows.make([0], [p], [T]), samp, logits="last" if kind == "prefill" else "all")
            if T == 1:
                tok = out["picks"][:, :1]
        dispatched.append((time.perf_counter() - t) / max(n, 1))
        jax.block_until_ready((out, eng.states))

    if args.ab:
        _ab(args, eng, run, pos, per)
        return
    t0 = time.perf_counter()
    run(1, pos)
    first_s = time.perf_counter() - t0
    at = pos + per
    run(args.warmup, at)
    at += args.warmup * per
    t0 = time.perf_counter()
    run(args.steps, at)
    wall = (time.perf_counter() - t0) / args.steps / per  # per token
    dispatch_ms = dispatched[-1] * 1e3 / per
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="strata_trace_")
    at += args.steps * per
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()  # inside the trace: its start and its export (seconds) are not the steps' time
        run(args.steps, at)
        traced_wall = (time.perf_counter() - t0) / args.steps / per
    s = trace.summarize(trace.load_events(trace_dir), args.steps * per, top=args.top)  # figures per token
    at += args.steps * per
    launches = None
    if args.hlo_launches or args.hlo_out:
        from strata_jax.pallas import structure

        if kind == "steps":
            hlo = eng.steps_hlo(tok, Rows.make([0], [at], [1]), samp, per)
        else:
            hlo = eng.stage_hlo(0, kind, tok, Rows.make([0], [at], [T]), samp,
                                logits="last" if kind == "prefill" else "all")
        with open(args.hlo_out or os.path.join(trace_dir, "step_hlo.txt"), "w") as f:
            f.write(hlo)
        launches = structure.hlo_launches(hlo) if args.hlo_launches else None
    r = {"model": args.random_from or args.geometry or args.model, "backend": jax.default_backend(),
         "device": str(jax.devices()[0]), "jax": jax.__version__, "kind": args.kind, "decode_steps": per,
         "rows": T, "prefill_chunk": eng.prefill_chunk, "max_context": args.max_context,
         "prompt_tokens": args.prompt_tokens, "env": {k: v for k, v in os.environ.items() if k.startswith("STRATA_")},
         "impl": os.environ.get("STRATA_PALLAS_IMPL", "auto"), "kernels_in_use": getattr(dispatch, "kernels_in_use", dispatch.on_gpu)(),
         "stack_layers": os.environ.get("STRATA_STACK_LAYERS", "auto"), "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "load_s": load_s, "first_step_s": first_s, "wall_ms": wall * 1e3, "dispatch_ms": dispatch_ms, "traced_wall_ms": traced_wall * 1e3,
         "busy_fraction": s["busy_ms"] / (traced_wall * 1e3) if traced_wall else None, "trace": s,
         "hlo_launches": launches,
         "trace_dir": trace_dir}
    c = s["copies"]
    cp = lambda k: f"{c[k]['count']:.1f} ({c[k]['bytes'] / 1e6:.2f} MB)" if k in c else "0"
    print(f"{args.kind}: {T} rows per call, prefill chunk {eng.prefill_chunk}, context {args.max_context}")
    print(f"{'model':36s} {'ms/step':>8s} {'busy':>6s} {'launches':>9s} {'D2H':>14s} {'D2D':>14s} {'copy kern.':>10s}")
    print(f"{str(r['model'])[-36:]:36s} {wall * 1e3:8.2f} {r['busy_fraction'] or 0:6.2f} {s['launches']:9.1f} "
          f"{cp('D2H'):>14s} {cp('D2D'):>14s} {c.get('copy_kernel', {}).get('count', 0):10.1f}")
    print("top kernels (ms/step, calls/step): " + "; ".join(f"{k[:40]} {t:.3f} x{n:.1f}"
                                                           for k, t, n in s["top_kernels"][:6]))
    print("launches by kind (calls/step, ms/step): " + "; ".join(f"{k[:40]} x{n:.1f} {t:.3f}"
                                                                 for k, t, n in s.get("kernel_families", [])[:16]))
    print(f"host time to launch a step (untraced, before waiting): {dispatch_ms:.2f} ms of {wall * 1e3:.2f} ms")
    g = s.get("gaps", {})
    print("device idle per step: " + "; ".join(f"{k} x{v['count']:.1f} {v['ms']:.3f} ms" for k, v in g.items()))
    print("host events (ms/step, calls/step): " + "; ".join(f"{k[:50]} {t:.3f} x{n:.1f}"
                                                          for k, t, n in s.get("host_top", [])[:14]))
    if launches is not None:
        top = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:6])
        print(f"compiled program (stage 0, one program per call): {launches['graphs']} command-buffer calls; "
              f"in graphs: {sum(launches['in_graphs'].values())} ({top(launches['in_graphs'])}); alone: "
              f"{sum(launches['outside'].values())} ({top(launches['outside'])})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1, default=str)


if __name__ == "__main__":
    main()
