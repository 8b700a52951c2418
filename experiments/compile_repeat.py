"""How compile time grows with the number of identical quantized-matmul calls in one program (not a test).

A step with per-layer weight buffers holds each layer's kernels once per layer. If XLA compiled each Pallas call
site on its own, a 28-layer program would pay 28x the kernels' compile time; if identical kernels are compiled
once, it pays about once. This program chains ``n`` calls of `qmatmul` on ``n`` different weights of one shape
and format (each call's output is the next call's input, as layers are) and times lowering and compiling for
n = 1, 4, 16, per kernel family and row count, next to the same chain of plain XLA bf16 products.

  python experiments/compile_repeat.py --out repeat.json            # on the GPU
  STRATA_PALLAS_IMPL=interpret python experiments/compile_repeat.py --small   # on a CPU: that it runs
  python experiments/compile_repeat.py --gguf /tmp/q15.gguf --families bytes,planar   # each matrix shape alone

Prints one line per (family, rows, n): lower s, compile s, compile s per call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def chain_fn(n: int, qtype, dim: int, family: str):
    import jax
    import jax.numpy as jnp

    from strata_jax.pallas.quant_matmul import qmatmul

    def f(x, ws):
        for w in ws:
            if family == "xla":
                x = jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
            else:
                x = qmatmul(x, w, qtype, dim, dim)
            x = x * 0.01  # keep values bounded (random weights)
        return x

    return jax.jit(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--counts", default="1,4,16")
    ap.add_argument("--rows", default="1,128")
    ap.add_argument("--families", default="bytes,planar,xla")
    ap.add_argument("--small", action="store_true", help="dim 256, counts 1,2, rows 1 (a CPU check)")
    ap.add_argument("--gguf", default=None, help="instead: compile each distinct matmul of this file's layers "
                    "(format, N, K) alone at 1 and 128 rows, per family, and time it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.gguf:
        return per_shape(args)
    if args.small:
        args.dim, args.counts, args.rows = 256, "1,2", "1"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from strata_jax.pallas.quant_matmul import api
    from strata_jax.testing.blocks import random_blocks

    qtype, dim = Q.Q4_K, args.dim
    rng = np.random.default_rng(0)
    res = []
    print(f"{'family':8s} {'rows':>5s} {'n':>4s} {'lower s':>8s} {'compile s':>10s} {'s/call':>7s}", flush=True)
    for family in args.families.split(","):
        os.environ["STRATA_QMATMUL"] = "planar" if family == "planar" else "bytes"
        for M in map(int, args.rows.split(",")):
            for n in map(int, args.counts.split(",")):
                if family == "xla":
                    ws = [jnp.asarray(rng.standard_normal((dim, dim)), jnp.bfloat16) for _ in range(n)]
                else:
                    ws = [api.prepare_weight(jnp.asarray(random_blocks(rng, qtype, dim, dim)), qtype, dim)
                          for _ in range(n)]
                x = jnp.asarray(rng.standard_normal((M, dim)), jnp.float32)
                f = chain_fn(n, qtype, dim, family)
                t0 = time.perf_counter()
                low = f.lower(x, ws)
                t1 = time.perf_counter()
                low.compile()
                t2 = time.perf_counter()
                r = {"family": family, "rows": M, "n": n, "lower_s": t1 - t0, "compile_s": t2 - t1}
                res.append(r)
                print(f"{family:8s} {M:5d} {n:4d} {r['lower_s']:8.2f} {r['compile_s']:10.2f} "
                      f"{r['compile_s'] / n:7.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(jax.devices()[0]), "qtype": "Q4_K", "dim": dim, "results": res}, fh, indent=1)


def per_shape(args) -> None:
    """Each distinct (format, N, K) matrix of ``args.gguf`` (2-D weights, block 0 and the head / embedding), one
    `qmatmul` alone per family and row count: which shape, if any, compiles slowly."""
    import jax
    import jax.numpy as jnp
    from gguf import GGMLQuantizationType

    from strata_jax.gguf.reader import open_gguf
    from strata_jax.pallas.quant_matmul import api, qmatmul

    g = open_gguf(args.gguf)
    seen, res = {}, []
    for name in g.tensors:
        t = g.info(name)
        if len(t.shape) != 2 or not (name.startswith("blk.0.") or not name.startswith("blk.")):
            continue
        seen.setdefault((int(t.qtype), t.shape[0], t.shape[1]), name)
    print(f"{'family':8s} {'tensor':28s} {'format':7s} {'N x K':>13s} {'rows':>5s} {'compile s':>10s}", flush=True)
    for family in args.families.split(","):
        if family == "xla":
            continue
        os.environ["STRATA_QMATMUL"] = family
        for (qt, n, k), name in sorted(seen.items(), key=lambda kv: kv[1]):
            w = api.prepare_weight(jnp.asarray(g.tensor_bytes(name)), qt, k)
            for M in map(int, args.rows.split(",")):
                x = jax.ShapeDtypeStruct((M, k), jnp.float32)
                f = jax.jit(lambda x, w, qt=qt, n=n, k=k: qmatmul(x, w, qt, n, k))
                t0 = time.perf_counter()
                try:
                    f.lower(x, w).compile()
                    dt = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001 -- report and go on (a bench, not a test)
                    dt = float("nan")
                    print(f"  {name}: {type(e).__name__}: {str(e)[:200]}")
                res.append({"family": family, "tensor": name, "qtype": qt, "n": n, "k": k, "rows": M,
                            "compile_s": dt})
                print(f"{family:8s} {name:28s} {GGMLQuantizationType(qt).name:7s} {f'{n}x{k}':>13s} {M:5d} {dt:10.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(jax.devices()[0]), "gguf": args.gguf, "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
