"""Prefill benchmark (not a test): warm prefill tok/s per (prompt length, chunk size), the first call's compile
seconds per chunk size, and the device's peak memory, to pick ``--prefill_chunk`` by measurement.

  python experiments/bench_prefill.py --model /tmp/q15.gguf --prompts 512,2048,8192 --chunks 128,256,512 \\
      --repeats 2 --budget_s 140 --out prefill.json --llamacpp_pp512 23852

(``/tmp/q15.gguf``: ``python -m strata_jax.testing.random_gguf fill experiments/data/qwen2.5-coder-1.5b.header.xz
/tmp/q15.gguf``, the 1.5B shapes and block formats with random blocks.)

One process and one `Engine` (one slot, ``--max_context`` cells: default the longest prompt + 64, rounded up to
256, the same for every case, since attention reads the slot's cells). What is reused across chunk sizes: the
weights, the slot's state and the slot reset function; each chunk size (``engine.prefill_chunk``) compiles its own
prefill program on its first call, which is timed as that size's first call (``compile_s``: the engine's compile
seconds during it). Then each prompt (greedy, random ids, the prefixes of one sequence) is read ``--repeats`` times
warm with `Engine.prefill` (one host read per chunk, as the solo path reads) and the best time is kept.

Memory: ``device.memory_stats()`` where the backend has it (`strata_jax.pipeline.memory.device_memory`; GPU; None on
a CPU): ``resident_bytes`` (in use after the load: weights + state) and, per case, ``peak_bytes`` (the process's
peak so far: JAX cannot reset it, so the cases run with chunk sizes ascending and prompts ascending, the order in
which the peak is expected to rise; a case that does not raise it reads the earlier peak;
``compile[C]["peak_bytes"]`` is the peak right after a chunk size's first call, whose compile may allocate device
buffers of its own, e.g. for autotuning). A read of a long prompt should not raise the peak above that of a short
one at the same chunk size: chunks are read one at a time.

``--budget_s``: before each call the time it will take is estimated (the previous call's compile for a first call,
the tokens at this chunk size's measured rate for a warm one) and cases that would pass the budget are skipped and
listed, so the script ends cleanly inside a device call's limit; the JSON is rewritten after every case.
``--llamacpp_pp512 TOKS``: llama.cpp's pp512 (llama-bench) on the same file, compared with the 512-token prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def table(res: dict) -> list[str]:
    """The result as text lines: tok/s per prompt (rows) and chunk size (columns), then compile seconds and peak
    memory per chunk size, and the llama.cpp comparison."""
    chunks, prompts = res["chunks"], res["prompts"]
    cases = {(c["prompt"], c["chunk"]): c for c in res["cases"]}
    w = 12

    def row(label, cells):
        return f"{label:>8}" + "".join(f"{x:>{w}}" for x in cells)

    lines = [f"prefill tok/s (warm, best of {res['repeats']}), {res['model']} on {res['device']}, max_context "
             f"{res['max_context']}", row("prompt", [f"chunk {c}" for c in chunks])]
    for p in prompts:
        lines.append(row(p, [f"{cases[p, c]['tok_s']:.1f}" if (p, c) in cases else "skipped" for c in chunks]))
    comp = res["compile"]
    lines.append(row("compile", [f"{comp[str(c)]['compile_s']:.1f} s" if str(c) in comp else "-" for c in chunks]))
    if res.get("resident_bytes") is not None:
        peaks = []
        for c in chunks:
            got = [r["peak_bytes"] for r in res["cases"] if r["chunk"] == c and r.get("peak_bytes")]
            peaks.append(f"{max(got) / 2**30:.2f}" if got else "-")
        lines.append(row("peak GiB", peaks) + f"   (running peak; resident after the load "
                     f"{res['resident_bytes'] / 2**30:.2f} GiB)")
    else:
        lines.append("peak memory: not reported by this backend")
    if res.get("llamacpp_pp512"):
        r512 = [cases[512, c] for c in chunks if (512, c) in cases]
        if r512:
            best = max(r512, key=lambda r: r["tok_s"])
            lines.append(f"vs llama.cpp pp512 {res['llamacpp_pp512']:.0f} tok/s: best 512-token prefill "
                         f"{best['tok_s']:.1f} tok/s (chunk {best['chunk']}) = "
                         f"{best['tok_s'] / res['llamacpp_pp512']:.3f} of it")
        else:
            lines.append("vs llama.cpp pp512: no 512-token prompt measured")
    if res["skipped"]:
        lines.append(f"skipped for the budget: {', '.join(res['skipped'])}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a .gguf file or a registry name")
    ap.add_argument("--prompts", default="512,2048,8192", help="prompt lengths in tokens")
    ap.add_argument("--chunks", default="128,256,512", help="prefill chunk sizes (multiples of 16)")
    ap.add_argument("--repeats", type=int, default=2, help="warm reads per case (the best is kept)")
    ap.add_argument("--max_context", type=int, default=None, help="cells of the slot (default: the longest prompt "
                    "+ 64, rounded up to 256)")
    ap.add_argument("--weights", default="auto", choices=("auto", "blocks", "f32"))
    ap.add_argument("--budget_s", type=float, default=None, help="stop starting calls that would end past this "
                    "many seconds since the start")
    ap.add_argument("--llamacpp_pp512", type=float, default=None, help="llama.cpp's pp512 tok/s on the same file")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args()
    t_start = time.perf_counter()

    import jax

    from strata_jax.models_registry import resolve_model
    from strata_jax.pipeline.engine import Engine, check_prefill_chunk
    from strata_jax.pipeline.memory import device_memory as memory
    from strata_jax.sampling import SamplingParams

    prompts, chunks = sorted(set(_ints(args.prompts))), sorted(set(_ints(args.chunks)))
    ctx = args.max_context or -(-(max(prompts) + 64) // 256) * 256
    for c in chunks:
        check_prefill_chunk(c, ctx)
    path = args.model if args.model.endswith(".gguf") else str(resolve_model(args.model))
    t0 = time.perf_counter()
    eng = Engine(path, max_context=ctx, weights=args.weights, prefill_chunk=chunks[0])
    devices = [s.device for s in eng.stages]
    mem0 = memory(devices)
    res = {"model": args.model, "backend": jax.default_backend(), "device": str(devices[0]), "max_context": ctx,
           "weights": eng.weights, "load_s": time.perf_counter() - t0, "prompts": prompts, "chunks": chunks,
           "repeats": args.repeats, "resident_bytes": mem0["bytes_in_use"] if mem0 else None,
           "llamacpp_pp512": args.llamacpp_pp512, "compile": {}, "cases": [], "skipped": [], "budget_s": args.budget_s}
    print(f"loaded {path} in {res['load_s']:.1f} s ({eng.weights} weights), max_context {ctx}, {res['device']}",
          flush=True)
    rng = np.random.default_rng(0)
    ids = rng.integers(100, min(eng.cfg.vocab_size, 30000), max(prompts)).tolist()
    greedy = SamplingParams(0.0)

    def save():
        res["seconds"] = time.perf_counter() - t_start
        res["table"] = table(res)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    def fits(estimate_s: float) -> bool:
        return args.budget_s is None or time.perf_counter() - t_start + estimate_s <= args.budget_s

    last_compile = None
    for C in chunks:
        eng.prefill_chunk = C
        rate = None  # tok/s measured at this chunk size (for the estimates)
        first = True
        for P in prompts:
            prompt = ids[:P]
            known = [r["tok_s"] for r in res["cases"] if r["prompt"] == P] + ([rate] if rate else [])
            est_warm = P / min(known) if known else 0.0  # the slowest rate seen: a conservative estimate
            est = est_warm * args.repeats + ((last_compile or 0.0) + est_warm if first else 0.0)
            if not fits(est):
                res["skipped"].append(f"prompt {P} x chunk {C}")
                print(f"prompt {P:>6} chunk {C:>4}: skipped (about {est:.0f} s, over the budget)", flush=True)
                continue
            if first:  # the first call at this chunk size: its prefill program compiles
                c0, t0 = eng.cache.compile_seconds, time.perf_counter()
                eng.prefill(0, prompt, greedy)
                mem = memory(devices)
                res["compile"][str(C)] = {"first_call_s": time.perf_counter() - t0,
                                          "compile_s": eng.cache.compile_seconds - c0, "prompt": P,
                                          "peak_bytes": mem["peak_bytes_in_use"] if mem else None}
                last_compile = res["compile"][str(C)]["first_call_s"]
                first = False
            best = None
            for _ in range(max(1, args.repeats)):
                t0 = time.perf_counter()
                eng.prefill(0, prompt, greedy)
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
                rate = P / best
                if not fits(P / rate):
                    break
            n_chunks = -(-P // C)
            mem = memory(devices)
            case = {"prompt": P, "chunk": C, "best_s": best, "tok_s": P / best, "chunks": n_chunks,
                    "ms_per_chunk": best / n_chunks * 1e3, "peak_bytes": mem["peak_bytes_in_use"] if mem else None}
            res["cases"].append(case)
            peak = f", peak {case['peak_bytes'] / 2**30:.2f} GiB" if mem else ""
            comp = res["compile"].get(str(C), {})
            extra = f" (first call {comp['first_call_s']:.1f} s, compiling {comp['compile_s']:.1f} s)" if (
                comp.get("prompt") == P) else ""
            print(f"prompt {P:>6} chunk {C:>4}: {case['tok_s']:9.1f} tok/s, {case['ms_per_chunk']:.1f} ms per chunk"
                  f"{peak}{extra}", flush=True)
            save()
    save()
    print("\n".join(res["table"]), flush=True)


if __name__ == "__main__":
    main()
