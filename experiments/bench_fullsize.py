"""Full-size geometry, random 4-bit-class weights made on the devices, split over the GPUs: build time, device memory
per GPU, prefill and decode ms per token (not a test).

  python experiments/bench_fullsize.py --geometry qwen3.8-flash-next --layer_split 24 --out full.json
  python experiments/bench_fullsize.py --geometry qwen3.6-35b-a3b --n_layer 4 --devices 1     # small smoke run

Geometries: configs/geometries/*.json (strata_jax.testing.random_weights).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def mem_per_device(devs) -> list[dict]:
    out = []
    for d in devs:
        try:
            s = d.memory_stats() or {}
        except Exception:  # CPU devices have no stats
            s = {}
        out.append({"device": str(d), "bytes_in_use": s.get("bytes_in_use"), "peak_bytes_in_use": s.get("peak_bytes_in_use")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="qwen3.8-flash-next")
    ap.add_argument("--n_layer", type=int, default=None)
    ap.add_argument("--layer_split", default=None)
    ap.add_argument("--devices", type=int, default=None, help="use the first N devices")
    ap.add_argument("--max_context", type=int, default=1024)
    ap.add_argument("--prompt_tokens", type=int, default=64)
    ap.add_argument("--decode_tokens", type=int, default=16)
    ap.add_argument("--windows", default="", help="also time verify windows of these row counts, e.g. 2,4,8")
    ap.add_argument("--mtp", type=int, default=0, help="add a random MTP block and run its chain of N drafts after "
                    "every window (its cost is then in every timing)")
    ap.add_argument("--decode_steps", default="", help="also time N decode steps per device program, e.g. 4,8 "
                    "(Engine.run_steps; the PLE table on the device)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from bench_decode import time_prefill_and_decode, time_windows
    from strata_jax.testing.random_weights import VirtualGGUF, load_geometry
    from strata_jax.pipeline.engine import Engine
    from strata_jax.pipeline.memory import state_bytes_per_slot, weight_bytes

    devs = jax.devices()[: args.devices] if args.devices else jax.devices()
    geom = load_geometry(args.geometry)
    t0 = time.perf_counter()
    v = VirtualGGUF(geom, n_layer=args.n_layer, mtp=args.mtp > 0)
    eng = Engine(v, max_context=args.max_context, layer_split=args.layer_split, devices=devs, progress=True)
    if args.mtp:
        eng.mtp.enable(args.mtp)
    jax.block_until_ready([s.params for s in eng.stages])
    t_build = time.perf_counter() - t0
    mem_after_load = mem_per_device(devs)
    steps = [int(v) for v in args.decode_steps.split(",") if v.strip()]
    t = time_prefill_and_decode(eng, args.prompt_tokens, args.decode_tokens, steps)
    t_decode = t["decode_s_per_token"]
    wins = time_windows(eng, args.prompt_tokens, [int(x) for x in args.windows.split(",") if x]) \
        if args.windows else {}
    wbytes = weight_bytes(eng)
    r = {
        "geometry": args.geometry, "n_layer": eng.cfg.n_layer, "layer_split": args.layer_split,
        "devices": [str(d) for d in devs], "jax": jax.__version__, "build_seconds": t_build,
        "weight_bytes_on_devices": wbytes, "state_bytes_per_slot_per_stage": state_bytes_per_slot(eng),
        "memory_after_load": mem_after_load, "memory_after_decode": mem_per_device(devs),
        "prefill_first_call_s": t["prefill_first_s"], "prefill_tok_s": args.prompt_tokens / t["prefill_s"],
        "step_first_call_s": t["step_first_s"], "decode_ms_per_token": t_decode * 1e3,
        "mtp_drafts": args.mtp, "verify_windows": {str(k): v for k, v in wins.items()},
        "steps_ms_per_token": {str(n): v * 1e3 for n, v in t["steps_s_per_token"].items()},
        "steps_same_tokens": {str(n): v for n, v in t["steps_same_tokens"].items()},
        "ple_table_on_device": bool(eng.ple is not None and eng.ple.on_device),
    }
    print(f"{args.geometry} n_layer={eng.cfg.n_layer} split={args.layer_split} build {t_build:.1f} s, "
          f"weights {wbytes / 1e9:.1f} GB, prefill {r['prefill_tok_s']:.1f} tok/s, decode {t_decode * 1e3:.2f} ms/token")
    for T, w in wins.items():
        print(f"  verify window T={T}: {w['ms']:.2f} ms (first call {w['first_s']:.1f} s)"
              + (f", MTP chain of {args.mtp} included" if args.mtp else ""))
    for m in r["memory_after_decode"]:
        if m["bytes_in_use"] is not None:
            print(f"  {m['device']}: {m['bytes_in_use'] / 2**30:.1f} GiB in use, peak {m['peak_bytes_in_use'] / 2**30:.1f} GiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
