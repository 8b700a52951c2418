"""Exactness harness for batch slots: every request's tokens equal its solo decode, in every batch mode.

For each mode it runs a staggered workload (admissions at different rounds, one cancellation, slot reuse: more
requests than slots) through `strata_jax.pipeline.scheduler.BatchScheduler` and compares every finished request's
tokens with `strata_jax.pipeline.solo.generate` on the same engine (greedy and seeded: temperature 0.7, top_k 20, a
seed per request). A cancelled request must be a prefix of its solo decode.

Usage (CPU, 4 host devices):
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python experiments/batch_exactness.py \
      --model smollm2-135m --stages 2 --modes serial,pipelined,batch_mtp,piped_mtp --new 8
  ... --model tests/fixtures/hybrid/qwen3next_f32.gguf --stages 2
The anchor's workload (Strata PR #1253's: 32 requests x 512 tokens, 4 concurrent), on GPUs, with MTP proposals:
  python experiments/batch_exactness.py --model qwen4exp_mtp.gguf --stages 2 --slots 4 --requests 32 --new 512 \
      --draft mtp --max_context 1024
``--model`` may be a registry name, a .gguf path, or a header file made by ``python -m
strata_jax.testing.random_gguf header`` (random weights of the real shapes). ``--same_device`` puts every stage on
the first device (exactness of the pipelined modes on a machine with fewer devices than stages; not a speed run).
The workload and the comparison are `strata_jax.testing.exactness` (shared with the tests).

Prints one line per mode: requests exact / total, windows, solo windows, proposals accepted, seconds; ``--out``
writes the same as JSON.
"""

from __future__ import annotations

import argparse
import os
import time

import jax

from strata_jax.pipeline.engine import Engine
from strata_jax.pipeline.groups import resolve_groups
from strata_jax.pipeline.memory import memory_lines
from strata_jax.testing.exactness import check, make_prompts, solo_tokens, workload


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--same_device", action="store_true", help="every stage on the first device")
    ap.add_argument("--slots", type=int, default=0, help="slots = concurrent requests (default: one per stage)")
    ap.add_argument("--requests", type=int, default=0, help="requests (default: slots + 1)")
    ap.add_argument("--modes", default="serial,pipelined,batch_mtp,piped_mtp")
    ap.add_argument("--new", type=int, default=8, help="tokens per request")
    ap.add_argument("--piped", type=int, default=2, help="proposals per window in piped_mtp")
    ap.add_argument("--draft", default="lookup", choices=["lookup", "mtp"], help="proposals of the proposal modes")
    ap.add_argument("--spec_min_p", type=float, default=0.0)
    ap.add_argument("--max_context", type=int, default=96)
    ap.add_argument("--sampled", default="0,1", help="0 = greedy, 1 = seeded; comma-separated")
    ap.add_argument("--out", default=None, help="JSON results")
    a = ap.parse_args()
    if os.environ.get("STRATA_LOG"):
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # compile times
    path = a.model
    if path.endswith((".header", ".header.xz")):
        from strata_jax.testing import random_gguf

        path, src = "/tmp/strata_exactness_random.gguf", path
        random_gguf.fill(src, path)
    elif not path.endswith(".gguf"):
        from strata_jax.models_registry import fetch_model

        path = str(fetch_model(path, quiet=True))
    devs = [jax.devices()[0]] * a.stages if a.same_device else jax.devices()[:a.stages]
    n_slots = a.slots or max(a.stages, 2)
    t0 = time.perf_counter()
    eng = Engine(path, max_context=a.max_context, n_slots=n_slots, devices=devs,
                 layer_split=None if a.stages == 1 else ",".join(
                     str(round(i * _n_layer(path) / a.stages)) for i in range(1, a.stages)))
    print(f"loaded {path} on {len(eng.stages)} stage(s) {[str(s.device) for s in eng.stages]}, {n_slots} slots in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    for line in memory_lines(eng):
        print(" ", line)
    factory = None
    if a.draft == "mtp":
        from strata_jax.proposers import make_proposer

        factory = lambda: make_proposer("mtp", eng, spec=max(a.piped, 1) + 1)  # noqa: E731
        factory()  # loads the MTP layer before any prompt is read
    prompts = make_prompts(a.requests or n_slots + 1, eng.cfg.vocab_size)
    ok_all = True
    report = {"model": a.model, "stages": len(eng.stages), "devices": [str(s.device) for s in eng.stages],
              "slots": n_slots, "requests": len(prompts), "new": a.new, "draft": a.draft, "runs": []}
    for sampled in [bool(int(s)) for s in a.sampled.split(",")]:
        reqs = workload(prompts, a.new, sampled)
        t1 = time.perf_counter()
        solo = {i: solo_tokens(eng, r) for i, r in enumerate(reqs)}
        print(f"solo references ({'seeded' if sampled else 'greedy'}): {len(reqs)} x {a.new} tokens in "
              f"{time.perf_counter() - t1:.1f} s", flush=True)
        for mode in a.modes.split(","):
            kw = {"serial": dict(batch_groups=1, batch_groups_given=True),
                  "pipelined": dict(), "batch_mtp": dict(batch_mtp=True),
                  "piped_mtp": dict(piped_mtp=a.piped, batch_groups=n_slots, batch_groups_given=True)}[mode]
            res = resolve_groups(n_slots, len(eng.stages), **kw)
            if res.mode != mode:
                print(f"{mode}: resolves to {res.mode} here ({res.message}); skipped")
                continue
            t1 = time.perf_counter()
            results, bad, sch = check(eng, res, reqs, solo, factory, a.spec_min_p)
            dt = time.perf_counter() - t1
            n_ok = len(results) - len(bad)
            ok_all &= not bad
            prop = sum(r.proposed for r in results)
            acc = sum(r.accepted for r in results)
            n_tok = sum(len(r.tokens) for r in results)
            print(f"{mode:9s} {'seeded' if sampled else 'greedy'}: {n_ok}/{len(results)} exact | "
                  f"windows {sch.stats['windows']} solo {sch.stats['solo_windows']} drains {sch.stats['drains']} | "
                  f"proposals {acc}/{prop} | {n_tok} tokens in {dt:.1f} s | {res.message}", flush=True)
            for b in bad:
                print("   MISMATCH", b)
            report["runs"].append({"mode": mode, "sampled": sampled, "exact": n_ok, "requests": len(results),
                                   "mismatches": bad, "windows": sch.stats["windows"],
                                   "solo_windows": sch.stats["solo_windows"], "proposed": prop, "accepted": acc,
                                   "tokens": n_tok, "seconds": dt,
                                   "stop_reasons": [r.stop_reason for r in results]})
    print("ALL EXACT" if ok_all else "MISMATCHES")
    report["all_exact"] = bool(ok_all)
    if a.out:
        import json

        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok_all else 1


def _n_layer(path: str) -> int:
    from strata_jax.models.registry import config_from_gguf
    from strata_jax.gguf import open_gguf

    return config_from_gguf(open_gguf(path)).n_layer


if __name__ == "__main__":
    raise SystemExit(main())
