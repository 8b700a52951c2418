"""Host-loop benchmark (not a test): does the user path keep up with the engine? (issue 12, "The host loop keeps
up").

For each loop it prints the engine-level time per token (the same device calls with no host work between them) and
the user path's time per token (the loop `strata-generate` runs: sampling bookkeeping, stop checks, detokenizing and
streaming the text), and their ratio (1.00: the host costs nothing; the goal is <= 1.05):

* ``solo greedy``: `strata_jax.pipeline.solo.generate` against one-row steps chained on the device
  (``experiments/bench_decode.py``'s `time_prefill_and_decode`);
* ``solo lookup`` / ``solo mtp`` (MTP when the model has an MTP layer): the speculative solo loop against the same
  mix of windows and steps, each timed alone (`bench_decode.time_windows`: window + commit, or a step);
* ``batch 2 slots``: `strata_jax.pipeline.scheduler.BatchScheduler` (serial windows, two greedy requests) against
  [2, 1] steps chained on the device.

The text is streamed as the CLI streams it: through the model's stream decoder into a buffer (token ids as text
when the model has no usable tokenizer, as the CLI prints them).

  python experiments/bench_host_loop.py                                   # CPU: the tiny qwen35 fixture, < 60 s
  python experiments/bench_host_loop.py --model smollm2-135m --tokens 128 --out host_loop.json   # a real model

Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import time_prefill_and_decode, time_windows  # noqa: E402

DEFAULT_MODEL = str(Path(__file__).parents[1] / "tests" / "fixtures" / "hybrid" / "qwen35_f32.gguf")


def streamer(engine):
    """``(on_token, text)``: the CLI's streaming callback into a buffer (`strata_jax.cli.generate.main`'s), and a
    function returning the text so far."""
    from strata_jax.cli.requests import usable_tokenizer

    buf = io.StringIO()
    tok, _ = usable_tokenizer(engine)
    if tok is None:
        return (lambda t: buf.write(f"{t} ")), buf.getvalue
    dec = tok.stream_decoder(skip_special=True)
    return (lambda t: buf.write(dec.feed(t))), buf.getvalue


def user_solo(engine, prompt, n: int, **kw):
    """Seconds per decoded token of one `generate` run (the rate's rule: windows that compiled left out), and its
    `Generation`."""
    from strata_jax.pipeline.solo import generate

    on_token, _text = streamer(engine)
    g = generate(engine, prompt, max_new_tokens=n + 1, eos_ids=(), on_token=on_token, **kw)
    st = g.stats
    return (st.decode_seconds - st.compiled_round_seconds) / max(st.decode_tokens_measured, 1), g


def engine_spec(engine, pos: int, g, spec: int) -> float:
    """Engine-level seconds per token of a speculative run's mix: its windows of ``spec`` rows (+ commit) and its
    one-row steps, each call timed alone at ``pos`` (means of 6 calls)."""
    ms = time_windows(engine, pos, [1, spec], reps=6)
    st = g.stats
    n_plain = st.windows - st.spec_windows
    return (st.spec_windows * ms[spec]["ms"] + n_plain * ms[1]["ms"]) * 1e-3 / max(st.generated - 1, 1)


def engine_batch(engine, prompts, n: int) -> float:
    """Seconds per token of ``n`` [B, 1] greedy steps chained on the device (every slot's pick feeds its next row;
    no host wait between steps), B = len(prompts) slots, after the prompts' prefills."""
    from strata_jax.sampling import RowSampling, SamplingParams
    from strata_jax.state import Rows

    B = len(prompts)
    sp = SamplingParams(0.0)
    firsts = [engine.prefill(b, p, sp)[0] for b, p in enumerate(prompts)]
    samp = RowSampling.make([sp] * B)
    pos = np.array([len(p) for p in prompts], np.int32)
    out, _ = engine.run("step", np.array(firsts, np.int32)[:, None], Rows.make(range(B), pos, [1] * B), samp)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        out, _ = engine.run("step", out["picks"], Rows.make(range(B), pos + i, [1] * B), samp)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / (n * B)


def user_batch(engine, prompts, n: int) -> float:
    """Seconds per token of one `BatchScheduler` run (serial windows) of greedy requests, from the step after
    their admission to the end."""
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.scheduler import BatchScheduler, Request

    res = resolve_groups(engine.n_slots, len(engine.stages), batch_groups=1, batch_groups_given=True)
    sch = BatchScheduler(engine, res)
    for p in prompts:
        on_token, _text = streamer(engine)
        sch.submit(Request(list(p), max_new_tokens=n + 2, on_token=on_token))
    sch.step()  # admits every request and launches the first window
    sch.step()
    k0 = sum(len(r.tokens) for r in sch.results.values())
    t0 = time.perf_counter()
    while sch.busy:
        sch.step()
    dt = time.perf_counter() - t0
    return dt / max(sum(len(r.tokens) for r in sch.results.values()) - k0, 1)


def paired(reps: int, engine_fn, user_fn) -> tuple[float, float]:
    """(engine, user) seconds per token: a warm-up call of each (it compiles), then ``reps`` calls of each,
    alternating so that both see the same load; the best of each."""
    engine_fn(), user_fn()
    te, tu = [], []
    for _ in range(reps):
        te.append(engine_fn())
        tu.append(user_fn())
    return min(te), min(tu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a .gguf path or a registry name (default: the tiny "
                    "qwen35 fixture, which has an MTP layer)")
    ap.add_argument("--prompt_tokens", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=48, help="decoded tokens per measured run")
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--max_context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5, help="timed runs of each measurement (engine and user path "
                    "alternating); the best of each is kept")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from strata_jax.models_registry import resolve_model
    from strata_jax.pipeline.engine import Engine
    from strata_jax.proposers import LookupProposer, MtpProposer

    t_start = time.perf_counter()
    path = args.model if args.model.endswith(".gguf") else str(resolve_model(args.model))
    eng = Engine(path, max_context=args.max_context)
    V = eng.cfg.vocab_size
    rng = np.random.default_rng(0)
    body = rng.integers(3, min(V, 30000), max(args.prompt_tokens // 2, 4)).tolist()
    prompt = (body + body)[:args.prompt_tokens]  # a repeat: prompt lookup has something to match
    rows = []

    def row(name, t_engine, t_user, extra=None):
        rows.append({"loop": name, "engine_ms_per_token": t_engine * 1e3, "user_ms_per_token": t_user * 1e3,
                     "ratio": t_user / t_engine, **(extra or {})})

    t_eng, t_user = paired(args.reps,
                           lambda: time_prefill_and_decode(eng, args.prompt_tokens, args.tokens)["decode_s_per_token"],
                           lambda: user_solo(eng, prompt, args.tokens)[0])
    row("solo greedy", t_eng, t_user)
    pos = len(prompt)
    spec_cases = [("solo lookup", LookupProposer)]
    if int(getattr(eng.cfg, "n_nextn", 0) or 0) > 0:
        spec_cases.append(("solo mtp", lambda: MtpProposer(eng, n_draft=args.spec - 1)))
    for name, make in spec_cases:
        prop = make()
        last = {}

        def user(prop=prop, last=last):
            t, last["g"] = user_solo(eng, prompt, args.tokens, proposer=prop, spec=args.spec)
            return t

        t_user = user()  # the run whose mix of windows and steps the engine side replays
        t_eng, t_user2 = paired(args.reps, lambda: engine_spec(eng, pos, last["g"], args.spec), user)
        st = last["g"].stats
        row(name, t_eng, min(t_user, t_user2),
            {"tokens_per_window": st.tokens_per_window, "spec_windows": st.spec_windows, "windows": st.windows})
    eng.mtp.set_chain(0)
    eng.set_slots(2)
    prompts = [prompt, prompt[::-1]]
    t_eng, t_user = paired(args.reps, lambda: engine_batch(eng, prompts, args.tokens),
                           lambda: user_batch(eng, prompts, args.tokens))
    row("batch 2 slots", t_eng, t_user)

    print(f"{jax.default_backend()} {jax.devices()[0]} | {Path(path).name} | {args.tokens} tokens per run, best of "
          f"{args.reps}")
    print(f"{'loop':16s} {'engine ms/tok':>14s} {'user ms/tok':>12s} {'ratio':>7s}")
    for r in rows:
        print(f"{r['loop']:16s} {r['engine_ms_per_token']:14.2f} {r['user_ms_per_token']:12.2f} {r['ratio']:7.2f}")
    print(f"({time.perf_counter() - t_start:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"backend": jax.default_backend(), "device": str(jax.devices()[0]), "model": path,
                       "tokens": args.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
