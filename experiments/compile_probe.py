"""Time XLA's lowering and compilation of one stage's jitted functions at a geometry's full-size shapes, without
building any weights (the stage module is built abstractly with `nnx.eval_shape`), to find which function, and
which Pallas kernel inside it, makes a compile slow (not a test).

Each (kernel selection, kind) pair compiles in its own subprocess under ``--timeout`` seconds (``--jobs`` at once),
so one slow compile is reported as such and the rest still run. Kernel selections (``--ops``): ``none`` (every op its plain-jnp
reference: ``STRATA_PALLAS_IMPL=reference``), ``all`` (``auto``), or one op-name prefix (``STRATA_PALLAS_OPS``,
see `strata_jax.pallas.dispatch`), e.g. ``grouped_experts``, ``qsa``, ``gdn``, ``quant_matmul``.

  python experiments/compile_probe.py --geometry qwen3.8-flash-next --n_layer 4 \
      --kinds prefill,step,window4 --ops none,all,grouped_experts,qsa,gdn,quant_matmul --out probe.json

Kinds: ``prefill`` (one `PREFILL_CHUNK`-row chunk, last-row logits), ``step`` (T = 1), ``windowT`` (a T-row verify
window, all logits), ``mtp_prefill`` / ``mtp_windowT`` (the MTP layer's catch-up + draft chain of ``--mtp`` drafts).
Prints one line per pair: lower seconds, compile seconds (or ``timeout``), and the HLO size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _one(geometry: str, n_layer: int, kind: str, max_context: int, mtp: int) -> dict:
    """Lower and compile one function in this process; returns timings."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from strata_jax.config import config_from_gguf
    from strata_jax.models import build_stage
    from strata_jax.models.random_weights import VirtualGGUF, load_geometry
    from strata_jax.pipeline.engine import PREFILL_CHUNK
    from strata_jax.pipeline.stages import build_mtp_fn, build_stage_fn, make_stage
    from strata_jax.sampling import RowSampling, SamplingParams
    from strata_jax.state import Rows

    v = VirtualGGUF(load_geometry(geometry), n_layer=n_layer, mtp=kind.startswith("mtp"))
    cfg = config_from_gguf(v)
    samp = RowSampling.make([SamplingParams(0.0)])
    mode = "prefill" if kind.endswith("prefill") else "window"
    T = PREFILL_CHUNK if mode == "prefill" else (1 if kind == "step" else int(kind.rsplit("window", 1)[1]))
    rows = Rows.make([0], [0], [T])
    t0 = time.perf_counter()
    if kind.startswith("mtp"):
        from strata_jax.layers.mtp import MTPHead

        head = nnx.eval_shape(lambda: MTPHead(v, cfg, None))
        gd, params = nnx.split(head)
        state = jax.eval_shape(lambda: head.init_state(1, max_context, jnp.float32, None))
        hc = int(getattr(cfg, "hc", 0) or 0)  # qwen4exp hands the MTP layer all hyper-connection streams
        h = jax.ShapeDtypeStruct((1, T, hc, cfg.n_embd) if hc > 1 else (1, T, cfg.n_embd), jnp.float32)
        nxt = jax.ShapeDtypeStruct((1, T), jnp.int32)
        n_use = jnp.asarray([T], jnp.int32)
        low = build_mtp_fn(gd, mode, mtp).lower(params, state, h, nxt, rows, n_use)
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
        low = fn.lower(st.params, state, toks, rows, toks, samp, extra)
    t_lower = time.perf_counter() - t0
    hlo_chars = len(low.as_text())
    t0 = time.perf_counter()
    low.compile()
    return {"lower_s": round(t_lower, 2), "compile_s": round(time.perf_counter() - t0, 2), "hlo_chars": hlo_chars,
            "backend": jax.default_backend()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="qwen3.8-flash-next", help="configs/geometries/<name>.json")
    ap.add_argument("--n_layer", type=int, default=4, help="trunk layers (one period of qwen4exp is 4)")
    ap.add_argument("--kinds", default="prefill,step,window4", help="comma list (see the module docstring)")
    ap.add_argument("--ops", default="none,all", help="comma list of kernel selections (see the module docstring)")
    ap.add_argument("--max_context", type=int, default=1024)
    ap.add_argument("--mtp", type=int, default=3, help="drafts in the MTP chain (mtp_* kinds)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per (selection, kind) subprocess")
    ap.add_argument("--jobs", type=int, default=1, help="pairs compiled at once (each its own process)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        print(json.dumps(_one(args.geometry, args.n_layer, args._child, args.max_context, args.mtp)))
        return
    pairs = [(ops, kind) for ops in args.ops.split(",") if ops for kind in args.kinds.split(",") if kind]
    print(f"{'ops':<16} {'kind':<14} {'lower s':>8} {'compile s':>10} {'HLO chars':>10}", flush=True)
    results = []

    def run_pair(pair):
        ops, kind = pair
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # several children may share one GPU
        env.pop("STRATA_PALLAS_OPS", None)
        if ops == "none":
            env["STRATA_PALLAS_IMPL"] = "reference"
        else:
            env["STRATA_PALLAS_IMPL"] = "auto"
            if ops != "all":
                env["STRATA_PALLAS_OPS"] = ops
        cmd = [sys.executable, os.path.abspath(__file__), "--geometry", args.geometry, "--n_layer",
               str(args.n_layer), "--max_context", str(args.max_context), "--mtp", str(args.mtp), "--_child", kind]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            r = json.loads(lines[-1]) if p.returncode == 0 and lines else {
                "error": (p.stderr.strip().splitlines() or ["no output"])[-1][:200]}
        except subprocess.TimeoutExpired:
            r = {"timeout_s": args.timeout}
        r.update(ops=ops, kind=kind, wall_s=round(time.perf_counter() - t0, 1))
        if "compile_s" in r:
            print(f"{ops:<16} {kind:<14} {r['lower_s']:>8.1f} {r['compile_s']:>10.1f} {r['hlo_chars']:>10}",
                  flush=True)
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
