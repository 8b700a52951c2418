"""Exactness harness for batch slots: every request's tokens equal its solo decode, in every batch mode.

For each mode it runs a staggered workload (admissions at different rounds, one cancellation, slot reuse: more
requests than slots) through `strata_jax.pipeline.scheduler.BatchScheduler` and compares every finished request's
tokens with `strata_jax.pipeline.solo.generate` on the same engine (greedy and seeded: temperature 0.7, top_k 20, a
seed per request). A cancelled request must be a prefix of its solo decode.

Usage (CPU, 4 host devices):
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python experiments/batch_exactness.py \
      --model smollm2-135m --stages 2 --modes serial,pipelined,batch_mtp,piped_mtp --new 8
  ... --model tests/fixtures/hybrid/qwen3next_f32.gguf --stages 2

Prints one line per mode: requests exact / total, windows, solo windows, proposals accepted, seconds.
"""

from __future__ import annotations

import argparse
import time

import jax

from strata_jax.pipeline.engine import Engine
from strata_jax.pipeline.groups import resolve_groups
from strata_jax.pipeline.scheduler import BatchScheduler, Request
from strata_jax.pipeline.solo import generate
from strata_jax.sampling import SamplingParams

GREEDY = SamplingParams(0.0)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(0.7, 20, 1.0, 0.0, seed)


def workload(prompts: list[list[int]], n_new: int, sampled: bool, cancel: bool = True) -> list[Request]:
    """Requests arriving one round apart; the second one is cancelled one round after it arrives (if ``cancel``),
    before proposals can finish it, while the first is still decoding beside the third."""
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(Request(list(p), max_new_tokens=n_new, sampling=seeded(1000 + i) if sampled else GREEDY,
                            arrival_round=i, cancel_round=(i + 1) if (cancel and i == 1) else None))
    return reqs


def solo_tokens(engine: Engine, req: Request) -> list[int]:
    """The request decoded alone (slot 0, zeroed first)."""
    engine.reset_slot(0)
    return generate(engine, list(req.prompt_ids), max_new_tokens=req.max_new_tokens, sampling=req.sampling,
                    eos_ids=req.stop_ids, slot=0).tokens


def check(engine: Engine, mode_res, reqs: list[Request], solo: dict, proposer_factory=None):
    """Run ``reqs`` in ``mode_res``'s mode; returns (results, list of mismatch descriptions, scheduler)."""
    sch = BatchScheduler(engine, mode_res, proposer_factory=proposer_factory)
    import copy

    results = sch.run([copy.copy(r) for r in reqs])
    bad = []
    for i, r in enumerate(results):
        ref = solo[i]
        if r.stop_reason == "cancelled":
            if r.tokens != ref[:len(r.tokens)]:
                bad.append(f"req {i} (cancelled) not a prefix: {r.tokens} vs {ref}")
        elif r.tokens != ref:
            bad.append(f"req {i} slot {r.slot}: {r.tokens} vs solo {ref}")
    return results, bad, sch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--slots", type=int, default=0, help="slots (default: one per stage)")
    ap.add_argument("--modes", default="serial,pipelined,batch_mtp,piped_mtp")
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--piped", type=int, default=2, help="proposals per window in piped_mtp")
    ap.add_argument("--max_context", type=int, default=96)
    ap.add_argument("--sampled", default="0,1", help="0 = greedy, 1 = seeded; comma-separated")
    a = ap.parse_args()
    path = a.model
    if not path.endswith(".gguf"):
        from strata_jax.models_registry import fetch_model

        path = str(fetch_model(path, quiet=True))
    devs = jax.devices()[:a.stages]
    n_slots = a.slots or max(a.stages, 2)
    t0 = time.perf_counter()
    eng = Engine(path, max_context=a.max_context, n_slots=n_slots, devices=devs,
                 layer_split=None if a.stages == 1 else ",".join(
                     str(round(i * _n_layer(path) / a.stages)) for i in range(1, a.stages)))
    print(f"loaded {path} on {len(eng.stages)} stage(s), {n_slots} slots in {time.perf_counter() - t0:.1f} s")
    for line in eng.memory_lines():
        print(" ", line)
    V = eng.cfg.vocab_size
    base = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]
    # each prompt ends by repeating its start, so prompt lookup has something to propose
    prompts = [[t % V for t in base[:10 + 2 * i] + base[:6]] for i in range(n_slots + 1)]
    ok_all = True
    for sampled in [bool(int(s)) for s in a.sampled.split(",")]:
        reqs = workload(prompts, a.new, sampled)
        solo = {i: solo_tokens(eng, r) for i, r in enumerate(reqs)}
        for mode in a.modes.split(","):
            kw = {"serial": dict(batch_groups=1, batch_groups_given=True),
                  "pipelined": dict(), "batch_mtp": dict(batch_mtp=True),
                  "piped_mtp": dict(piped_mtp=a.piped)}[mode]
            res = resolve_groups(n_slots, len(eng.stages), **kw)
            if res.mode != mode:
                print(f"{mode}: resolves to {res.mode} here ({res.message}); skipped")
                continue
            t1 = time.perf_counter()
            results, bad, sch = check(eng, res, reqs, solo)
            n_ok = len(results) - len(bad)
            ok_all &= not bad
            prop = sum(r.proposed for r in results)
            acc = sum(r.accepted for r in results)
            print(f"{mode:9s} {'seeded' if sampled else 'greedy'}: {n_ok}/{len(results)} exact | "
                  f"windows {sch.stats['windows']} solo {sch.stats['solo_windows']} drains {sch.stats['drains']} | "
                  f"proposals {acc}/{prop} | {time.perf_counter() - t1:.1f} s | {res.message}")
            for b in bad:
                print("   MISMATCH", b)
    print("ALL EXACT" if ok_all else "MISMATCHES")
    return 0 if ok_all else 1


def _n_layer(path: str) -> int:
    from strata_jax.config import config_from_gguf
    from strata_jax.gguf import open_gguf

    return config_from_gguf(open_gguf(path)).n_layer


if __name__ == "__main__":
    raise SystemExit(main())
