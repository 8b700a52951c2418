"""Compile time of the sampler's pieces on this machine's backend, each alone, with every input a jit argument
(not a constant XLA could fold), at the 1.5B vocabulary: which op makes a program that holds the sampler compile
slowly (not a test).

On the H200 (2026-12-02) the pick with the pairwise-tree softmax of `strata_jax.layers.exact` compiled in 66.7 s
(29.7 s per softmax over 1,024 candidates) and made the 1.5B step compile in ~90 s instead of ~11 s; top_k, cumsum
and the threefry draw took 0.3 s each. The sampler now takes `strata_jax.pallas.rows.softmax` (a kernel there).

  python experiments/compile_sampler.py                     # every piece, each in its own process
  python experiments/compile_sampler.py --only pick_tokens --vocab 248320
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PIECES = ("pick_tokens", "pick_tokens_greedy", "softmax_exact", "softmax_rows", "top_k", "cumsum", "threefry")


def _one(which: str, vocab: int, rows: int) -> str:
    import jax
    import jax.numpy as jnp

    from strata_jax.layers import exact
    from strata_jax.pallas import rows as row_ops
    from strata_jax.sampling import TOP_K_MAX, RowSampling, pick_tokens

    sds = jax.ShapeDtypeStruct
    x = sds((rows, vocab), jnp.float32)
    cand = sds((rows, TOP_K_MAX), jnp.float32)
    f32, i32, u32 = (sds((rows,), d) for d in (jnp.float32, jnp.int32, jnp.uint32))

    def samp(greedy):
        return RowSampling(f32, i32, f32, f32, u32, all_greedy=greedy)

    fns = {
        "pick_tokens": (lambda lg, s, c: pick_tokens(lg, s, c), (x, samp(False), i32)),
        "pick_tokens_greedy": (lambda lg, s, c: pick_tokens(lg, s, c), (x, samp(True), i32)),
        "softmax_exact": (exact.softmax, (cand,)),
        "softmax_rows": (row_ops.softmax, (cand,)),
        "top_k": (lambda lg: jax.lax.top_k(lg, TOP_K_MAX), (x,)),
        "cumsum": (lambda v: jnp.cumsum(v, axis=-1), (cand,)),
        "threefry": (jax.vmap(lambda s, c: jax.random.uniform(jax.random.fold_in(jax.random.key(s), c), ())),
                     (u32, u32)),
    }
    fn, args = fns[which]
    t0 = time.perf_counter()
    low = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    low.compile()
    t2 = time.perf_counter()
    return f"{which:<20} {jax.default_backend():<5} lower {t1 - t0:6.2f} s  compile {t2 - t1:7.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PIECES), help=f"comma list of {PIECES}")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per piece (each its own process)")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        print(_one(a._child, a.vocab, a.rows), flush=True)
        return
    for which in a.only.split(","):
        if which not in PIECES:
            sys.exit(f"--only: unknown piece {which!r} (one of {PIECES})")
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", which, "--vocab", str(a.vocab),
               "--rows", str(a.rows)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            out = [ln for ln in p.stdout.splitlines() if ln.startswith(which)]
            print(out[-1] if out else f"{which:<20} error: {(p.stderr.strip().splitlines() or ['?'])[-1][:200]}",
                  flush=True)
        except subprocess.TimeoutExpired:
            print(f"{which:<20} compile > {a.timeout:.0f} s (timeout)", flush=True)


if __name__ == "__main__":
    main()
