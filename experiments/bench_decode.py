"""Decode benchmark (not a test): prefill tok/s, decode tok/s, and weight bytes read per decoded token over the
decode time as a fraction of the bandwidth ceiling measured in the same run.

Ceiling: on a GPU, a bf16 GEMV of an 8192 x 28672 matrix (bytes of weight read per second; ~4.0 TB/s on an H200);
on the CPU, a large copy (bytes read per second).

  python experiments/bench_decode.py --model smollm2-135m                         # CPU, real weights
  python experiments/bench_decode.py --random_from experiments/data/qwen2.5-coder-1.5b.header.xz   # same shapes/formats

Prints a short table and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def ceiling_bytes_per_s() -> tuple[float, str]:
    if jax.default_backend() in ("gpu", "cuda"):
        w = jax.random.normal(jax.random.key(0), (28672, 8192), jnp.bfloat16)
        x = jax.random.normal(jax.random.key(1), (1, 8192), jnp.bfloat16)
        f = jax.jit(lambda x, w: x @ w.T)
        f(x, w).block_until_ready()
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            y = f(x, w)
        y.block_until_ready()
        dt = (time.perf_counter() - t0) / n
        return w.size * 2 / dt, "bf16 GEMV 8192x28672"
    a = jnp.ones((64 * 1024 * 1024,), jnp.float32)  # 256 MiB
    f = jax.jit(lambda a: a + 1.0)
    f(a).block_until_ready()
    n = 5
    t0 = time.perf_counter()
    for _ in range(n):
        b = f(a)
    b.block_until_ready()
    dt = (time.perf_counter() - t0) / n
    return a.size * 4 / dt, "CPU copy 256 MiB (bytes read)"


def time_prefill_and_decode(eng, prompt_tokens: int, decode_tokens: int, steps=()) -> dict:
    """Greedy prefill of random ids then one-row decode steps whose tokens stay on the device (no host wait
    between steps), then for each n > 1 in ``steps`` the same with n steps per device program
    (`Engine.run_steps`). Returns first-call and warm seconds: ``prefill_first_s``, ``prefill_s``,
    ``step_first_s``, ``decode_s_per_token``, ``steps_s_per_token`` {n: seconds}."""
    from strata_jax.sampling import RowSampling, SamplingParams
    from strata_jax.state import Rows

    rng = np.random.default_rng(0)
    prompt = rng.integers(100, min(eng.cfg.vocab_size, 30000), prompt_tokens).tolist()
    sp = SamplingParams(0.0)
    r = {}
    t0 = time.perf_counter()
    eng.prefill(0, prompt, sp)
    r["prefill_first_s"] = time.perf_counter() - t0
    print(f"prefill of {prompt_tokens} tokens, first call: {r['prefill_first_s']:.1f} s", flush=True)
    t0 = time.perf_counter()
    first, _ = eng.prefill(0, prompt, sp)
    r["prefill_s"] = time.perf_counter() - t0
    samp = RowSampling.make([sp])
    pos = len(prompt)
    tok = jnp.asarray([[first]], jnp.int32)
    t0 = time.perf_counter()
    eng.window(np.asarray(tok), Rows.make([0], [pos], [1]), samp, kind="step")
    r["step_first_s"] = time.perf_counter() - t0
    print(f"decode step, first call: {r['step_first_s']:.1f} s", flush=True)
    out = None
    warm = 4  # the loop's own small ops (the picks' slice) compile on their first use: not decode time
    eng.prefill(0, prompt, sp)  # the state of the prompt again (the step above advanced a hybrid's recurrent state)
    picks = []
    for i in range(warm + decode_tokens):
        if i == warm:
            jax.block_until_ready(out)
            t0 = time.perf_counter()
        out, _ = eng.run("step", tok, Rows.make([0], [pos + i], [1]), samp)
        tok = out["picks"][:, :1]
        picks.append(tok)
    jax.block_until_ready(out)
    r["decode_s_per_token"] = (time.perf_counter() - t0) / decode_tokens
    one = np.concatenate([np.asarray(p) for p in picks], axis=1)[0]
    r["steps_s_per_token"], r["steps_same_tokens"] = {}, {}
    for n in steps:  # n steps per device program (Engine.run_steps): same tokens, one launch per n
        if n <= 1 or not eng.can_run_steps:
            continue
        eng.prefill(0, prompt, sp)
        tok = jnp.asarray([[first]], jnp.int32)
        calls = max(decode_tokens // n, 1)
        picks = []
        for i in range(2 + calls):  # two warm calls: the first compiles
            if i == 2:
                jax.block_until_ready(out)
                t0 = time.perf_counter()
            out = eng.run_steps(tok, Rows.make([0], [pos + i * n], [1]), samp, n)
            tok = out["last"]
            picks.append(out["picks"])
        jax.block_until_ready(out)
        r["steps_s_per_token"][n] = (time.perf_counter() - t0) / (calls * n)
        got = np.concatenate([np.asarray(p) for p in picks], axis=1)[0]
        k = min(len(got), len(one))
        r["steps_same_tokens"][n] = bool((got[:k] == one[:k]).all())  # greedy: the one-step loop's tokens
        print(f"{n} steps per call: {1 / r['steps_s_per_token'][n]:.1f} tok/s, "
              f"{'same' if r['steps_same_tokens'][n] else 'DIFFERENT'} {k} tokens as one step per call", flush=True)
    return r


def time_windows(eng, pos: int, sizes, reps: int = 8) -> dict:
    """Verify windows of T rows (the solo speculative path's call: window + commit of all T rows) at ``pos``:
    ``{T: {"first_s", "ms"}}`` with ``ms`` the warm mean over ``reps`` (each waited for). The same positions are
    re-verified each time, so the state stays consistent."""
    from strata_jax.sampling import RowSampling, SamplingParams
    from strata_jax.state import Rows

    samp = RowSampling.make([SamplingParams(0.0)])
    rng = np.random.default_rng(1)
    out = {}
    for T in sizes:
        toks = rng.integers(100, min(eng.cfg.vocab_size, 30000), (1, T)).astype(np.int32)
        rows = Rows.make([0], [pos], [T])
        kind = "window" if T > 1 else "step"

        def one():
            res = eng.window(toks, rows, samp, kind=kind)
            if kind == "window":
                eng.commit(rows, res.pending, np.zeros((1,), np.int32) + 1)
            jax.block_until_ready(eng.states)

        t0 = time.perf_counter()
        one()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(reps):
            one()
        out[T] = {"first_s": first, "ms": (time.perf_counter() - t0) / reps * 1e3}
    return out


def weight_bytes_per_token(engine) -> int:
    """Bytes of weights a decode step reads: everything except the embedding table, of which one row is read
    (a tied head reads the whole table as the head)."""
    from strata_jax.state import tree_bytes

    total = sum(tree_bytes(s.params) for s in engine.stages)
    g = engine.gguf
    if g.has("output.weight"):
        t = g.info("token_embd.weight")
        total -= t.nbytes - t.nbytes // t.shape[0]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--random_from", help="a header file (python -m strata_jax.testing.random_gguf header): bench "
                    "random weights of those shapes and formats")
    ap.add_argument("--prompt_tokens", type=int, default=256)
    ap.add_argument("--decode_tokens", type=int, default=64)
    ap.add_argument("--max_context", type=int, default=1024)
    ap.add_argument("--decode_steps", default="1", help="comma-separated steps per device program to time besides "
                    "one step per call, e.g. 1,2,4,8 (Engine.run_steps)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from strata_jax.models_registry import resolve_model
    from strata_jax.pipeline.engine import Engine

    if args.random_from:
        from strata_jax.testing import random_gguf

        path = "/tmp/strata_bench_random.gguf"
        random_gguf.fill(args.random_from, path)
    else:
        path = str(resolve_model(args.model))
    ceil, ceil_what = ceiling_bytes_per_s()
    t0 = time.perf_counter()
    eng = Engine(path, max_context=args.max_context)
    print(f"loaded {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    steps = [int(v) for v in args.decode_steps.split(",") if v.strip()]
    t = time_prefill_and_decode(eng, args.prompt_tokens, args.decode_tokens, steps)
    t_prefill, t_decode = t["prefill_s"], t["decode_s_per_token"]
    wb = weight_bytes_per_token(eng)
    r = {
        "backend": jax.default_backend(), "device": str(jax.devices()[0]), "model": args.random_from or args.model,
        "prefill_tok_s": args.prompt_tokens / t_prefill, "decode_tok_s": 1.0 / t_decode,
        "decode_ms": t_decode * 1e3, "weight_bytes_per_token": wb, "ceiling_bytes_per_s": ceil,
        "ceiling": ceil_what, "fraction_of_ceiling": wb / t_decode / ceil,
        "compiles": eng.cache.compiles,
        "steps_tok_s": {str(n): 1.0 / v for n, v in t["steps_s_per_token"].items()},
        "steps_same_tokens": {str(n): v for n, v in t["steps_same_tokens"].items()},
    }
    print(f"{'model':40s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'weights/token':>14s} {'ceiling':>12s} {'fraction':>9s}")
    print(f"{str(r['model'])[-40:]:40s} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.2f} "
          f"{wb / 1e6:11.1f} MB {ceil / 1e9:9.1f} GB/s {r['fraction_of_ceiling']:9.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
