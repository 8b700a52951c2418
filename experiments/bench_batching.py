"""Batching benchmark (issue 7): every batch arm interleaved in one run, R repetitions, medians (not a test).

One command runs, for each workload and stream count, every arm once per repetition (rep 1: all arms, rep 2: all
arms, ...), after a warm-up pass that compiles every arm's window shapes, and writes ``bench_batching.json`` (every
run, calibration, summary, goals), ``bench_batching.md`` (tables, goals, how it was measured) and
``bench_batching.png`` (total tok/s per arm; skipped with a message when matplotlib is missing) to ``--out``.

Arms (the flags of `strata_jax.pipeline.groups.resolve_groups` they stand for; the engine has ``--slots`` slots,
default the largest stream count, so a run with fewer streams is a server with idle slots):
  pipelined     pipelined groups without proposals (``--batch_groups auto``: one group per stage; the default)
  serial        serial windows (``--batch_groups 1``)
  batch_mtp     serial batch MTP (``--batch_mtp``: each slot's token + 1 proposal, 4 slots per 8-row window)
  piped1..3     piped MTP with N = 1, 2, 3 proposals (``--piped_mtp N --batch_groups <slots>``: groups of one slot)
  piped_lookup  piped with prompt-lookup proposals (N = ``--piped_n``)
  piped_draft   piped with draft-model proposals (N = ``--piped_n``; model set a)
With one stream every arm is a lone slot (the scheduler's solo return); it is then also compared with the solo path
(`strata_jax.pipeline.solo.generate`) given the same proposals and window cap (``solo``, ``solo_<source><P>``).

Proposal sources of the MTP-named arms (batch_mtp, piped1..3): set b and tiny: "synthetic acceptance" (the replay
proposer below at a fixed rate per workload: prose 62%, code 88%, edit 97%); set a: the 0.5B draft model.

Model sets:
  a     Qwen2.5-Coder-1.5B split at layer 14 over 2 devices; prompt lookup and the Qwen2.5-Coder-0.5B draft model.
        ``--weights real`` (the cached files): proposals are made for real. ``--weights random`` (a GPU machine,
        where the 1 GB files cannot travel): both files are rebuilt from experiments/data/*.header with random
        blocks (same shapes, formats and bytes) and acceptance is replayed from ``--acceptance`` (recorded from the
        real weights with ``--record_acceptance``): "replayed acceptance". The real lookup / draft proposers still
        run beside the replay so their cost is in the timing.
  b     the full-size Qwen3.8-Flash-Next geometry (configs/geometries) with random 4-bit-class weights made on the
        devices, split at layer 24; MTP-style proposals at set rates: "synthetic acceptance". When the model has an
        MTP layer, the MTP chain runs after every window (its cost is timed; its
        drafts are replaced by the replayed ones); the JSON says whether it ran.
  tiny  the committed tiny qwen4exp fixture with a random MTP block appended (`strata_jax.testing.mtp_block`;
        ``--no_mtp``: without) on 2 CPU devices, a few tokens: a smoke run of the whole pipeline, MTP chain included
        (CPU; no performance claim).

Replayed acceptance (`strata_jax.testing.batching.replay.ReplayProposer`): a first pass decodes every prompt once
without proposals (exact: every batch mode gives the solo tokens, tests/test_slots.py) and keeps the tokens as the
reference. A proposal at output position j offers the reference tokens after j; the first rejected one (and those
after it) is replaced by (reference + 1) % vocab, which the target's exact-match verify rejects. Acceptance draws
are keyed by (request, position, k) (numpy's SeedSequence), so every arm and repetition sees the same draws. The
output never changes: the target verifies every proposal.

Parts: this file builds the engines and runs, times and calibrates the arms; the workloads and arms, the replayed
acceptance and the report are `strata_jax.testing.batching` (``workload``, ``replay``, ``report``; tested by
tests/test_bench_batching.py).

Usage:
  # CPU smoke run of the whole pipeline (~30 min on the shared 2-core machine, mostly compiles)
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python experiments/bench_batching.py --model_set tiny \\
      --streams 1,2 --tokens 8 --reps 2 --n_methods 4 --out /tmp/bb_tiny
  # record lookup / draft acceptance from the real 1.5B + 0.5B (the engine's CPU path, float32 weights)
  python experiments/bench_batching.py --model_set a --tokens 160 \\
      --record_acceptance experiments/data/acceptance_qwen2.5-coder.json
  # GPU, 2 devices: model set a (random blocks, replayed acceptance) and b (full-size, synthetic acceptance).
  # build/ is git-ignored: the compile cache and the JSON that --resume continues stay on a warm machine between
  # calls, so a run cut by --time_budget_s is finished by the next call.
  python3 experiments/bench_batching.py --model_set a --weights random \\
      --acceptance experiments/data/acceptance_qwen2.5-coder.json --compile_cache_dir build/jax_cache \\
      --time_budget_s 480 --resume --out build/bench_a; cp -r build/bench_a $OUT/
  python3 experiments/bench_batching.py --model_set b --compile_cache_dir build/jax_cache \\
      --time_budget_s 480 --resume --out build/bench_b; cp -r build/bench_b $OUT/

Timing: total output tok/s = tokens generated after each request's first token (which comes from its prefill),
summed over the streams, over the decode wall time (from the last admission to the last token; all requests arrive
at once, so admissions come first and are timed apart as ``prefill_s``). Per-stream tok/s = a request's tokens
after its first over its time from the last admission to its last token. Per-stage window times and each device's
idle fraction are estimated, not traced: every compiled call is counted during the timed runs (per stage, kind and
row layout), each such call is then timed alone on its stage with ``jax.block_until_ready`` (median of
``--calib_reps``; a window's commit on that stage included), and idle = 1 - sum(calls x time alone) / decode wall.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from strata_jax.sampling import SamplingParams
from strata_jax.testing.batching.replay import (DEFAULT_RATES, MAX_PROPOSALS, Acceptance, ReplayBook, ReplayProposer,
                                                draft_positions, lookup_positions, profile_from_positions)
from strata_jax.testing.batching.report import compute_goals, markdown, plot, summarize
from strata_jax.testing.batching.workload import (ALL_ARMS, N_METHODS, Arm, encode_prompts, make_arms, parse_tokens,
                                                  prompt_texts, requests, solo_baseline)

GREEDY = SamplingParams(0.0)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "experiments" / "data"
HEADER_1P5B = DATA / "qwen2.5-coder-1.5b.header.xz"
HEADER_0P5B = DATA / "qwen2.5-coder-0.5b.header.xz"
TINY_MODEL = ROOT / "tests" / "fixtures" / "hybrid" / "qwen4exp_f32.gguf"


# ==== engine-side helpers (JAX) ========================================================================================
class CallCounter:
    """Counts the compiled-function calls an engine makes, by compile-cache key (``(stage, kind, B, T, logits)``
    for stage functions, ``("mtp", ...)`` for the MTP chain), by wrapping ``engine.cache.get`` (one get per call)."""

    def __init__(self, engine):
        self.engine = engine
        self.counts: collections.Counter = collections.Counter()
        self.enabled = True
        orig = engine.cache.get

        def get(key, build, _orig=orig):
            if self.enabled:
                self.counts[key] += 1
            return _orig(key, build)

        engine.cache.get = get

    def take(self) -> dict:
        """The counts since the last take (and reset)."""
        c = dict(self.counts)
        self.counts.clear()
        return c


def set_mtp_chain(engine, n: int) -> int:
    """Run the model's MTP chain with ``n`` drafts after every window (0: off) through ``MtpChain.set_chain``;
    returns the chain length now running (0 when the model has none)."""
    return engine.mtp.set_chain(n)


def time_call_alone(engine, key: tuple, pos: int, reps: int) -> float:
    """Seconds of one call of compiled function ``key`` = (stage, kind, B, T, logits) alone on its stage (median of
    ``reps`` after one untimed call): the earlier stages run first (untimed) for a hidden of the right shape; a
    ``window``'s commit on the stage is included; everything the call wrote is waited for
    (``jax.block_until_ready``). Slots 0..B-1 at position ``pos`` are overwritten (callers re-read their prompts)."""
    import jax
    import jax.numpy as jnp

    from strata_jax.sampling import RowSampling
    from strata_jax.state import Rows

    k, kind, B, T, logits = key
    pos = max(0, min(int(pos), engine.max_context - T - 2))
    toks = np.ones((B, T), np.int32)
    rows = Rows.make(list(range(B)), [pos] * B, [T] * B)
    samp = RowSampling.make([GREEDY] * B)
    tok_d = jnp.asarray(toks)
    x = tok_d
    for i in range(k):
        out, _ = engine.run_stage(i, kind, x, rows, tok_d, samp, logits)
        x = out["hidden"]
    keep = np.full((B,), 1, np.int32)

    def once():
        out, pending = engine.run_stage(k, kind, x, rows, tok_d, samp, logits)
        if kind == "window" and pending is not None:
            engine.commit_stage(k, rows, pending, keep)
        jax.block_until_ready((out, engine.states[k], getattr(engine, "mtp_state", None)))

    once()
    ts = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        once()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def record_acceptance(args) -> int:
    """``--record_acceptance PATH``: reference decodes of the real Qwen2.5-Coder-1.5B, then what prompt lookup and
    the 0.5B draft model would offer / have accepted at every output position; writes per-workload profiles
    (`profile_from_positions`) and the raw positions as JSON."""
    from strata_jax.gguf import open_gguf
    from strata_jax.models_registry import resolve_model
    from strata_jax.tokenizer import Tokenizer

    t_all = time.perf_counter()
    target_path = str(resolve_model(args.target_model))
    draft_path = str(resolve_model(args.draft_model))
    tok = Tokenizer.from_gguf(open_gguf(target_path))
    stop = tuple(sorted(tok.eos_ids))
    lo, hi = parse_tokens(args.tokens)
    works = args.workloads.split(",")
    prompts = {w: encode_prompts(tok, prompt_texts(w, args.record_streams, args.n_methods), tok.vocab_size)
               for w in works}
    out = {"what": "prompt-lookup and draft-model acceptance per output position, from the real weights",
           "target_model": args.target_model, "draft_model": args.draft_model, "tokens": hi,
           "backend": "engine", "max_k": MAX_PROPOSALS, "workloads": {}}
    refs: dict[str, list] = {}
    partial = Path(str(args.record_acceptance) + ".partial")  # references so far: a killed run starts from here
    if partial.exists():
        got = json.loads(partial.read_text())
        if got.get("tokens") == hi and got.get("target_model") == args.target_model:
            refs.update(got["refs"])
            print(f"  {len(refs)} reference(s) kept from {partial}", flush=True)
    print(f"recording: target {target_path} (the engine), {hi} tokens per request", flush=True)
    from strata_jax.pipeline.engine import Engine
    from strata_jax.pipeline.solo import generate
    from strata_jax.proposers import LookupProposer
    from strata_jax.sampling import RowSampling
    from strata_jax.state import Rows

    ctx = max(len(p) for ps in prompts.values() for p in ps) + hi + 16
    todo = [(w, i, p) for w in works for i, p in enumerate(prompts[w]) if f"{w}/{i}" not in refs]
    if todo:
        t0 = time.perf_counter()
        eng = Engine(target_path, max_context=ctx)
        print(f"  target loaded in {time.perf_counter() - t0:.0f} s (weights {eng.weights})", flush=True)
        for w, i, p in todo:
            t0 = time.perf_counter()
            g = generate(eng, p, max_new_tokens=hi, sampling=GREEDY, eos_ids=stop, proposer=LookupProposer(),
                         spec=8)  # exact: the plain greedy tokens, in fewer windows where lookup pays
            refs[f"{w}/{i}"] = g.tokens
            print(f"  {w}/{i}: {len(p)} prompt tokens, {len(g.tokens)} generated in {time.perf_counter() - t0:.0f} s",
                  flush=True)
            partial.write_text(json.dumps({"tokens": hi, "target_model": args.target_model, "refs": refs}))
        del eng
    deng = Engine(draft_path, max_context=ctx)

    def teach(ids):
        """The draft's greedy pick after every position of ``ids`` (teacher-forced: prefill chunks, all rows)."""
        deng.reset_slot(0)
        picks = []
        C = deng.prefill_chunk
        for c in range(0, len(ids), C):
            chunk = ids[c:c + C]
            toks = np.zeros((1, C), np.int32)
            toks[0, :len(chunk)] = chunk
            o, _ = deng.run("prefill", toks, Rows.make([0], [c], [len(chunk)]), RowSampling.make([GREEDY]),
                            logits="all")
            picks.append(np.asarray(o["picks"])[0, :len(chunk)])
        return np.concatenate(picks)

    for w in works:
        lo_o, lo_a, dr_o, dr_a, rooms = [], [], [], [], []
        raw = {}
        for i, p in enumerate(prompts[w]):
            ref = refs[f"{w}/{i}"]
            o1, a1 = lookup_positions(p, ref)
            picks = teach(list(p) + list(ref))
            o2, a2 = draft_positions(picks, len(p), ref)
            lo_o += o1
            lo_a += a1
            dr_o += o2
            dr_a += a2
            rooms += [min(MAX_PROPOSALS, len(ref) - 1 - j) for j in range(len(ref) - 1)]
            raw[str(i)] = {"prompt_tokens": len(p), "generated": len(ref), "lookup_offered": o1,
                           "lookup_accepted": a1, "draft_offered": o2, "draft_accepted": a2}
        out["workloads"][w] = {"lookup": profile_from_positions(lo_o, lo_a, rooms=rooms),
                               "draft": profile_from_positions(dr_o, dr_a, rooms=rooms), "requests": raw}
        lk, dr = out["workloads"][w]["lookup"], out["workloads"][w]["draft"]
        print(f"  {w}: lookup offers at {100 * lk['offered_at_least'][0]:.0f}% of positions, accepted "
              f"{100 * lk['acceptance']:.0f}%; draft accepted {100 * dr['acceptance']:.0f}% "
              f"(first proposal {100 * dr['accept_given'][0]:.0f}%)", flush=True)
    out["seconds"] = time.perf_counter() - t_all
    out["references"] = refs
    Path(args.record_acceptance).parent.mkdir(parents=True, exist_ok=True)
    with open(args.record_acceptance, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.record_acceptance}")
    return 0


# ==== the benchmark ====================================================================================================
@dataclasses.dataclass
class Setup:
    """What a model set resolved to."""

    engine: Any
    draft_engine: Any
    tokenizer: Any
    model: str
    weights: str
    split: str
    arms: list
    mtp_source: str
    sources: dict          # workload -> source -> Acceptance or "real"
    stop_ids: tuple
    smoke: bool
    notes: list


def _build(args) -> Setup:
    import jax

    from strata_jax.pipeline.engine import Engine

    notes = []
    lo, hi = parse_tokens(args.tokens)
    rates = dict(DEFAULT_RATES)
    for kv in filter(None, (args.rates or "").split(",")):
        k, _, v = kv.partition("=")
        rates[k.strip()] = float(v)
    slots = args.slots or max(2, max(int(s) for s in args.streams.split(",")))
    if args.model_set == "tiny":
        split = args.layer_split or "2"
        model, weights = str(TINY_MODEL.relative_to(ROOT)), "real (tiny random fixture)"
        src = str(TINY_MODEL)
        if not args.no_mtp:  # append a random MTP block so that the MTP chain runs as on model set b
            import tempfile

            from strata_jax.testing.mtp_block import add_mtp_block

            src = add_mtp_block(src, str(Path(tempfile.gettempdir()) / "bench_batching_tiny_mtp.gguf"), seed=1)
            model += " + a random MTP block (strata_jax.testing.mtp_block)"
        names = args.arms.split(",") if args.arms else [a for a in ALL_ARMS if a != "piped_draft"]
        mtp_source, smoke = "rate", True
    elif args.model_set == "a":
        split = args.layer_split or "14"
        names = args.arms.split(",") if args.arms else [a for a in ALL_ARMS if a != "piped_draft"]
        mtp_source, smoke = "draft", False
        notes.append("batch_mtp and piped1..3 draw from the 0.5B draft model on this model set (it has no MTP layer);"
                     " piped_draft would repeat piped3")
    elif args.model_set == "b":
        split = args.layer_split or "24"
        model, weights = args.geometry, "random 4-bit-class blocks made on the devices"
        names = args.arms.split(",") if args.arms else [a for a in ALL_ARMS if a not in ("piped_lookup", "piped_draft")]
        mtp_source, smoke = "rate", False
    else:
        raise SystemExit(f"--model_set {args.model_set!r}: expected a, b or tiny")
    n_stages = len([c for c in split.split(",") if c.strip()]) + 1
    devs = jax.devices()[:n_stages]
    if len(devs) < n_stages:
        raise SystemExit(f"--layer_split {split} needs {n_stages} devices; {len(jax.devices())} visible "
                         f"(on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n_stages})")
    arms = make_arms(names, mtp_source, args.piped_n)
    tokenizer, draft_engine = None, None
    if args.model_set == "a":
        from strata_jax.models_registry import resolve_model

        want_random = args.weights == "random"
        if not want_random:
            try:
                src, dsrc = str(resolve_model(args.target_model)), str(resolve_model(args.draft_model))
            except Exception as e:  # noqa: BLE001
                raise SystemExit(f"--weights real: {e} (use --weights random with --acceptance on a machine without "
                                 f"the files)")
            weights = "real"
        else:
            from strata_jax.testing import random_gguf

            src, dsrc = "/tmp/bench_batching_1p5b.gguf", "/tmp/bench_batching_0p5b.gguf"
            t0 = time.perf_counter()

            def fill(header: Path, dst: str) -> None:  # once per machine: a marker says the file is complete
                if not header.exists():
                    raise SystemExit(f"{header} is missing (python -m strata_jax.testing.random_gguf header "
                                     f"<file.gguf> {header})")
                if not os.path.exists(dst + ".done"):
                    random_gguf.fill(str(header), dst)
                    Path(dst + ".done").write_text("filled\n")

            fill(HEADER_1P5B, src)
            if any(a.source == "draft" for a in arms):
                fill(HEADER_0P5B, dsrc)
            weights = f"random blocks from experiments/data/*.header ({time.perf_counter() - t0:.0f} s to write)"
        model = f"{args.target_model} (draft {args.draft_model})"
    elif args.model_set == "b":
        from strata_jax.testing.random_weights import VirtualGGUF, load_geometry
        import inspect

        kw = {"mtp": True} if "mtp" in inspect.signature(VirtualGGUF.__init__).parameters and not args.no_mtp else {}
        src = VirtualGGUF(load_geometry(args.geometry), n_layer=args.n_layer, **kw)
        if not kw:
            notes.append("no MTP block in the random model (--no_mtp, or VirtualGGUF has no mtp option here): the MTP "
                         "chain does not run")
    # the prompts decide the context
    from strata_jax.gguf import open_gguf
    from strata_jax.tokenizer import Tokenizer

    if args.model_set == "a":
        tokenizer = Tokenizer.from_gguf(open_gguf(src))
    elif args.model_set == "b":
        tokenizer = Tokenizer.from_gguf(open_gguf(random_gguf.header_file(HEADER_1P5B), header_only=True))
        notes.append("prompts tokenized with the Qwen2.5 tokenizer of experiments/data/qwen2.5-coder-1.5b.header.xz "
                     "(the full-size model's own tokenizer is not available; ids < 151936 < its vocabulary)")
    t0 = time.perf_counter()
    eng_kw = dict(n_slots=slots, layer_split=split, devices=devs, compile_cache_size=96)
    # context: longest prompt + most tokens + room for a window
    max_prompt = 0
    for w in args.workloads.split(","):
        texts = prompt_texts(w, slots, args.n_methods)
        if tokenizer is not None:
            ids = encode_prompts(tokenizer, texts, tokenizer.vocab_size)
        else:
            ids = [t.encode() for t in texts]
        max_prompt = max(max_prompt, max(len(x) for x in ids))
    ctx_need = max_prompt + hi + 2 * MAX_PROPOSALS + 4
    ctx = args.max_context or int(math.ceil(ctx_need / 256) * 256)
    engine = Engine(src, max_context=ctx, **eng_kw)
    jax.block_until_ready([s.params for s in engine.stages])
    notes.append(f"engine built in {time.perf_counter() - t0:.0f} s; max_context {ctx}")
    if args.model_set == "a" and any(a.source == "draft" for a in arms):
        draft_engine = Engine(dsrc, max_context=ctx, n_slots=slots, devices=[devs[-1]], compile_cache_size=64)
        if weights == "real":
            from strata_jax.proposers import check_same_tokenizer

            check_same_tokenizer(engine, draft_engine)
        notes.append(f"draft model on {devs[-1]} (the last stage's device), one draft slot per target slot")
    acc = _load_acceptance(args, weights, rates, notes)
    sources = {}
    for w in args.workloads.split(","):
        s = {"rate": Acceptance.fixed(rates[w])}
        for kind in ("lookup", "draft"):
            if args.model_set == "a" and weights == "real" and acc is None:
                s[kind] = "real"
            elif acc is not None and w in acc["workloads"]:
                s[kind] = Acceptance.from_profile(acc["workloads"][w][kind])
            elif args.model_set == "tiny" and kind == "lookup":
                s[kind] = "real"
            else:
                s[kind] = None
        sources[w] = s
    keep = []
    for a in arms:
        if a.source in ("lookup", "draft") and any(sources[w][a.source] is None for w in sources):
            notes.append(f"arm {a.name} left out: no {a.source} acceptance for this model set (give --acceptance, or "
                         f"real weights)")
            continue
        if a.source == "draft" and draft_engine is None:
            notes.append(f"arm {a.name} left out: no draft model on this model set")
            continue
        keep.append(a)
    if args.model_set == "tiny":
        try:
            tokenizer = engine.tokenizer
            tokenizer.encode("x")
        except Exception:  # noqa: BLE001
            tokenizer = None
            notes.append("the tiny fixture's tokenizer does not load: prompts are their UTF-8 bytes as token ids")
    stop = () if args.model_set in ("b", "tiny") or weights != "real" else tuple(sorted(tokenizer.eos_ids))
    if not stop:
        notes.append("no stop ids: every request generates exactly its token count (random weights)")
    return Setup(engine, draft_engine, tokenizer, model, weights, split, keep, mtp_source, sources, stop, smoke, notes)


def _load_acceptance(args, weights: str, rates: dict, notes: list):
    if args.acceptance:
        with open(args.acceptance) as f:
            acc = json.load(f)
        notes.append(f"lookup / draft acceptance replayed from {args.acceptance} (recorded from {acc.get('target_model')}"
                     f" + {acc.get('draft_model')}, {acc.get('tokens')} tokens per request, backend "
                     f"{acc.get('backend')})")
        return acc
    if args.model_set == "a" and weights != "real":
        raise SystemExit("--weights random needs --acceptance PATH (record it with --record_acceptance on a machine "
                         "with the real files)")
    return None


def _factory(setup: Setup, arm: Arm, workload: str, book: ReplayBook, chain: int) -> tuple[Callable | None, str]:
    """``() -> Proposer`` for an arm (None for arms without proposals) and its acceptance label."""
    if arm.n_props == 0:
        return None, ""
    src = setup.sources[workload][arm.source]
    eng, deng = setup.engine, setup.draft_engine
    slot = [0]

    def draft_cost():
        from strata_jax.proposers import DraftModelProposer

        s = slot[0] % deng.n_slots
        slot[0] += 1
        return DraftModelProposer(deng, None, slot=s, window=arm.n_props + 1)

    if src == "real":
        if arm.source == "lookup":
            from strata_jax.proposers import LookupProposer

            return LookupProposer, "real acceptance"
        return draft_cost, "real acceptance"
    if arm.source == "rate":
        mtp_eng = eng if chain else None
        return (lambda: ReplayProposer(book, src, "mtp-synthetic", mtp_engine=mtp_eng)), src.label
    if arm.source == "lookup":
        from strata_jax.proposers import LookupProposer

        return (lambda: ReplayProposer(book, src, "lookup-replay", cost=LookupProposer())), src.label
    return (lambda: ReplayProposer(book, src, "draft-replay", cost=draft_cost())), src.label


def _compiles(setup: Setup) -> int:
    return setup.engine.cache.compiles + (setup.draft_engine.cache.compiles if setup.draft_engine else 0)


def run_batch(setup: Setup, arm: Arm, reqs: list, factory, refs: dict | None) -> dict:
    """One scheduler run of ``reqs`` in ``arm``'s mode; returns its record (times in seconds)."""
    import jax

    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.scheduler import BatchScheduler

    eng = setup.engine
    res = resolve_groups(eng.n_slots, len(eng.stages), **arm.flags(eng.n_slots))
    if res.mode != arm.mode:
        raise SystemExit(f"arm {arm.name}: resolves to {res.mode} ({res.message})")
    c0 = _compiles(setup)
    kw = {"proposer_factory": factory} if factory is not None else {}
    # reads at a chunk before every window, as before --batch_read_share existed: the decode phase (after the last
    # first token) is what this compares, and the earlier records were taken so
    sch = BatchScheduler(eng, res, read_share=1.0, **kw)
    t0 = time.perf_counter()
    results = sch.run(reqs)
    jax.block_until_ready(eng.states)
    wall = time.perf_counter() - t0
    t_dec = max(r.first_token_s for r in results)
    end = max(r.finished_s for r in results)
    dec = max(end - t_dec, 1e-9)
    per = [(len(r.tokens) - 1) / max(r.finished_s - t_dec, 1e-9) for r in results]
    rec = {"mode": res.mode, "resolution": res.message, "wall_s": wall, "prefill_s": t_dec, "decode_s": dec,
           "tokens": [len(r.tokens) for r in results], "total_tok_s": sum(len(r.tokens) - 1 for r in results) / dec,
           "per_stream_tok_s": float(np.median(per)), "per_stream": per,
           "windows": sch.stats["windows"], "solo_windows": sch.stats["solo_windows"],
           "windows_per_slot": float(np.mean([r.windows for r in results])),
           "proposed": sum(r.proposed for r in results), "accepted": sum(r.accepted for r in results),
           "stop": [r.stop_reason for r in results], "compiles": _compiles(setup) - c0}
    if refs is not None:
        rec["exact"] = all(r.tokens == refs[r.rid][:len(r.tokens)] for r in results)
    return rec


def run_solo(setup: Setup, arm: Arm, req, factory, refs: dict | None) -> dict:
    """The solo path (`strata_jax.pipeline.solo.generate`, slot 0) with ``arm``'s proposals and window cap."""
    from strata_jax.pipeline.solo import generate

    c0 = _compiles(setup)
    prop = factory() if factory is not None else None
    g = generate(setup.engine, list(req.prompt_ids), max_new_tokens=req.max_new_tokens, sampling=req.sampling,
                 eos_ids=req.stop_ids, slot=0, proposer=prop, spec=arm.n_props + 1 if prop is not None else 0)
    st = g.stats
    n = max(st.generated - 1, 0)
    rec = {"mode": "solo", "resolution": "solo path", "wall_s": st.prefill_seconds + st.decode_seconds,
           "prefill_s": st.prefill_seconds, "decode_s": st.decode_seconds, "tokens": [st.generated],
           "total_tok_s": n / st.decode_seconds if st.decode_seconds > 0 else 0.0,
           "per_stream_tok_s": n / st.decode_seconds if st.decode_seconds > 0 else 0.0,
           "windows": st.windows, "solo_windows": st.windows, "windows_per_slot": float(st.windows),
           "proposed": st.proposed, "accepted": st.accepted, "stop": [st.stop_reason],
           "compiles": _compiles(setup) - c0}
    if refs is not None:
        rec["exact"] = g.tokens == refs[req.rid][:len(g.tokens)]
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_set", default="tiny", choices=("a", "b", "tiny"))
    ap.add_argument("--streams", default="1,2,4", help="concurrent requests per run, comma-separated")
    ap.add_argument("--workloads", default="code,edit,prose")
    ap.add_argument("--tokens", default="600", help="generated tokens per request: N, or LO-HI spread over streams")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arms", default=None, help=f"comma-separated, of {', '.join(ALL_ARMS)} (default: the set's)")
    ap.add_argument("--layer_split", default=None, help="default: a 14, b 24, tiny 2")
    ap.add_argument("--slots", type=int, default=0, help="engine slots (default: the largest stream count)")
    ap.add_argument("--piped_n", type=int, default=3, help="proposals per window of piped_lookup / piped_draft")
    ap.add_argument("--rates", default="", help="synthetic acceptance per workload, e.g. prose=0.62,code=0.88")
    ap.add_argument("--out", default=None, help="output folder (bench_batching.json/.md/.png)")
    ap.add_argument("--acceptance", default=None, help="replay lookup / draft acceptance from this JSON")
    ap.add_argument("--record_acceptance", default=None, help="record acceptance from the real weights to this JSON")
    ap.add_argument("--record_streams", type=int, default=1, help="requests per workload to record")
    ap.add_argument("--weights", default="real", choices=("real", "random"), help="model set a")
    ap.add_argument("--target_model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft_model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--geometry", default="qwen3.8-flash-next", help="model set b")
    ap.add_argument("--n_layer", type=int, default=None, help="model set b: fewer layers (same shapes)")
    ap.add_argument("--n_methods", type=int, default=N_METHODS, help="methods in the edit file (33: ~3K tokens)")
    ap.add_argument("--max_context", type=int, default=0)
    ap.add_argument("--warmup_tokens", type=int, default=6)
    ap.add_argument("--calib_reps", type=int, default=5)
    ap.add_argument("--no_solo", action="store_true", help="skip the solo-path baselines at one stream")
    ap.add_argument("--no_mtp", action="store_true", help="sets b and tiny: no MTP block, so no MTP chain runs")
    ap.add_argument("--dry_run", action="store_true", help="build the engines and prompts, print the plan, stop")
    ap.add_argument("--compile_cache_dir", default=None, help="JAX persistent compilation cache (kept across runs)")
    ap.add_argument("--time_budget_s", type=float, default=0, help="start no new timed run after this (0: none)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the timed runs and references already in --out/bench_batching.json (same model set "
                         "and tokens) and run only the missing ones")
    args = ap.parse_args(argv)
    if args.record_acceptance:
        return record_acceptance(args)
    t_start = time.perf_counter()
    import jax

    if args.compile_cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    setup = _build(args)
    eng = setup.engine
    counter = CallCounter(eng)
    dcounter = CallCounter(setup.draft_engine) if setup.draft_engine is not None else None
    streams = sorted(int(s) for s in args.streams.split(","))
    if max(streams) > eng.n_slots:
        raise SystemExit(f"--streams {args.streams}: more streams than --slots {eng.n_slots}")
    works = args.workloads.split(",")
    lo, hi = parse_tokens(args.tokens)
    V = eng.cfg.vocab_size
    tok_vocab = setup.tokenizer.vocab_size if setup.tokenizer is not None else V
    prompts = {w: encode_prompts(setup.tokenizer, prompt_texts(w, eng.n_slots, args.n_methods), min(V, tok_vocab))
               for w in works}
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"model_set": args.model_set, "model": setup.model, "weights": setup.weights, "smoke": setup.smoke,
            "command": "python " + " ".join([os.path.relpath(__file__, ROOT)]
                                            + (sys.argv[1:] if argv is None else list(argv))),
            "devices": [str(s.device) for s in eng.stages], "jax": jax.__version__, "backend": jax.default_backend(),
            "layer_split": setup.split, "stages": len(eng.stages), "slots": eng.n_slots, "tokens": args.tokens,
            "reps": args.reps, "streams": streams, "arms": [a.name for a in setup.arms],
            "prompt_tokens": {w: [len(p) for p in prompts[w]] for w in works}, "notes": setup.notes}
    has_mtp = int(getattr(eng.cfg, "n_nextn", 0) or 0) > 0
    meta["mtp_chain_available"] = bool(has_mtp)
    meta["mtp_note"] = ("runs after every window of the MTP-named arms (N drafts), off in the others" if has_mtp else
                        "not run (the model has no MTP layer)")
    print(f"model set {args.model_set}: {setup.model}, {len(eng.stages)} stages, {eng.n_slots} slots, "
          f"arms {', '.join(a.name for a in setup.arms)}", flush=True)
    for n in setup.notes:
        print("  " + n, flush=True)
    if args.dry_run:
        print(json.dumps({k: meta[k] for k in ("model", "weights", "devices", "layer_split", "slots", "arms",
                                                "prompt_tokens", "mtp_note")}, indent=1))
        print(f"max_context {eng.max_context}; per run: streams {streams}, workloads {works}, tokens {args.tokens}; "
              f"{len(setup.arms)} arms (+ solo baselines at one stream) x {args.reps} repetitions")
        return 0
    records: list[dict] = []
    prev_refs: dict[str, list] = {}
    if args.resume and out_dir and (out_dir / "bench_batching.json").exists():
        prev = json.loads((out_dir / "bench_batching.json").read_text())
        pm = prev.get("meta", {})
        if (pm.get("model_set"), pm.get("tokens"), pm.get("slots")) != (args.model_set, args.tokens, eng.n_slots):
            raise SystemExit(f"--resume: {out_dir}/bench_batching.json is for model set {pm.get('model_set')}, "
                             f"tokens {pm.get('tokens')}, {pm.get('slots')} slots")
        records += [r for r in prev.get("records", []) if not r.get("warmup")]
        prev_refs = prev.get("references", {})
        print(f"resume: {len(records)} timed runs kept from {out_dir}/bench_batching.json", flush=True)
    done = {(r["rep"], r["workload"], r["streams"], r["arm"]) for r in records}
    refs: dict[str, list] = {}
    state = {"meta": meta, "records": records, "references": refs}

    def save():
        if out_dir:
            with open(out_dir / "bench_batching.json", "w") as f:
                json.dump(state, f, indent=1, default=str)

    # ---- reference pass: every prompt decoded once without proposals (exact); the replay proposer offers these
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.scheduler import BatchScheduler

    book = ReplayBook(V)
    ref_arm = Arm("pipelined", "pipelined") if len(eng.stages) > 1 else Arm("serial", "serial")
    t_ref = time.perf_counter()
    for w in works:
        reqs = requests(prompts[w], eng.n_slots, hi, hi, setup.stop_ids, w)
        if all(q.rid in prev_refs for q in reqs):
            for q in reqs:
                refs[q.rid] = list(prev_refs[q.rid])
                book.add(q.prompt_ids, refs[q.rid], q.rid)
            print(f"reference {w}: kept from the earlier run", flush=True)
            continue
        set_mtp_chain(eng, 0)
        t0 = time.perf_counter()
        res = resolve_groups(eng.n_slots, len(eng.stages), **ref_arm.flags(eng.n_slots))
        out = BatchScheduler(eng, res).run(reqs)
        for r, q in zip(out, reqs):
            refs[r.rid] = list(r.tokens)
            book.add(q.prompt_ids, r.tokens, r.rid)
        print(f"reference {w}: {eng.n_slots} requests x {hi} tokens ({res.mode}) in {time.perf_counter() - t0:.1f} s",
              flush=True)
    meta["reference_seconds"] = time.perf_counter() - t_ref

    def one(arm: Arm, w: str, s: int, rep: int, tokens: tuple[int, int], warmup: bool) -> dict:
        chain = set_mtp_chain(eng, arm.n_props if arm.source == "rate" else 0)
        factory, label = _factory(setup, arm, w, book, chain)
        made = []
        if factory is not None:
            def factory(inner=factory):
                p = inner()
                made.append(p)
                return p
        reqs = requests(prompts[w], s, tokens[0], tokens[1], setup.stop_ids, w)
        counter.take()
        if dcounter:
            dcounter.take()
        if arm.mode == "solo":
            rec = run_solo(setup, arm, reqs[0], factory, refs)
        else:
            rec = run_batch(setup, arm, reqs, factory, refs)
        rec.update(arm=arm.name, workload=w, streams=s, rep=rep, label=label, warmup=warmup, mtp_chain=chain,
                   source=arm.source, n_props=arm.n_props,
                   calls={repr(k): v for k, v in counter.take().items()},
                   draft_calls={repr(k): v for k, v in (dcounter.take() if dcounter else {}).items()})
        replays = [p for p in made if isinstance(p, ReplayProposer)]
        if replays:
            rec["replay"] = {k: sum(getattr(p, k) for p in replays)
                             for k in ("offered", "accepted_planned", "diverged", "mtp_reads")}
        if s == 1 and arm.mode != "solo" and not args.no_solo:
            rec["solo_ref"] = solo_baseline(arm).name
        return rec

    def plan(s: int) -> list[Arm]:
        arms = list(setup.arms)
        if s == 1 and not args.no_solo:
            seen = []
            for a in setup.arms:
                b = solo_baseline(a)
                if b.name not in [x.name for x in seen]:
                    seen.append(b)
            arms += seen
        return arms

    # ---- warm-up: every arm's shapes compile here (shortest prompts, few tokens)
    wshort = min(works, key=lambda w: max(len(p) for p in prompts[w]))
    t0 = time.perf_counter()
    c0 = _compiles(setup)
    for s in streams:
        for arm in plan(s):
            rec = one(arm, wshort, s, 0, (args.warmup_tokens, args.warmup_tokens), True)
            records.append(rec)
    meta["warmup"] = {"seconds": time.perf_counter() - t0, "compiles": _compiles(setup) - c0, "workload": wshort}
    print(f"warm-up: {meta['warmup']['compiles']} compiles in {meta['warmup']['seconds']:.1f} s", flush=True)
    save()

    # ---- timed repetitions: rep 1 all arms, rep 2 all arms, ...
    stopped = None
    for rep in range(1, args.reps + 1):
        for w in works:
            for s in streams:
                for arm in plan(s):
                    if (rep, w, s, arm.name) in done:
                        continue
                    if args.time_budget_s and time.perf_counter() - t_start > args.time_budget_s:
                        stopped = f"time budget of {args.time_budget_s:.0f} s reached at rep {rep}, {w}, {s} streams"
                        break
                    rec = one(arm, w, s, rep, (lo, hi), False)
                    records.append(rec)
                    print(f"rep {rep} {w:5s} {s} stream(s) {arm.name:14s} {rec['total_tok_s']:9.2f} tok/s total "
                          f"{rec['per_stream_tok_s']:8.2f} per stream | windows {rec['windows']:4d} | proposals "
                          f"{rec['accepted']}/{rec['proposed']} | compiles {rec['compiles']} | exact "
                          f"{rec.get('exact')}", flush=True)
                    save()
                if stopped:
                    break
            if stopped:
                break
        if stopped:
            break
    if stopped:
        print("stopped: " + stopped, flush=True)
        meta["stopped"] = stopped

    # ---- calibration: each counted call alone on its stage
    t0 = time.perf_counter()
    counter.enabled = False
    if dcounter:
        dcounter.enabled = False
    calib: dict[tuple, float] = {}
    import ast

    timed = [r for r in records if not r["warmup"]]
    need = collections.defaultdict(set)  # (workload, chain) -> keys
    dneed = collections.defaultdict(set)
    for r in timed:
        for k in r["calls"]:
            key = ast.literal_eval(k)
            if key[0] != "mtp" and key[1] != "prefill":
                need[(r["workload"], r["mtp_chain"])].add(key)
        for k in r["draft_calls"]:
            dneed[r["workload"]].add(ast.literal_eval(k))
    pos_of = {w: max(len(p) for p in prompts[w]) + hi // 2 for w in works}
    for (w, chain), keys in sorted(need.items()):
        set_mtp_chain(eng, chain)
        for key in sorted(keys):
            calib[("t", w, chain, key)] = time_call_alone(eng, key, pos_of[w], args.calib_reps)
    set_mtp_chain(eng, 0)
    if setup.draft_engine is not None:
        for w, keys in dneed.items():
            for key in sorted(keys):
                calib[("d", w, 0, key)] = _time_draft_call(setup.draft_engine, key, pos_of[w], args.calib_reps)
    meta["calibration_seconds"] = time.perf_counter() - t0
    n_dev = len(eng.stages)
    last_dev = n_dev - 1
    for r in timed:
        busy = [0.0] * n_dev
        per_stage: dict[int, tuple] = {}
        for k, c in r["calls"].items():
            key = ast.literal_eval(k)
            t = calib.get(("t", r["workload"], r["mtp_chain"], key))
            if t is None:
                continue
            busy[key[0]] += c * t
            if key[0] not in per_stage or c > per_stage[key[0]][0]:
                per_stage[key[0]] = (c, t, key)
        for k, c in r["draft_calls"].items():
            t = calib.get(("d", r["workload"], 0, ast.literal_eval(k)))
            if t is not None:
                busy[last_dev] += c * t
        r["stage_ms"] = [per_stage[i][1] * 1e3 if i in per_stage else None for i in range(n_dev)]
        r["stage_shape"] = [str(per_stage[i][2]) if i in per_stage else None for i in range(n_dev)]
        r["busy_s"] = busy
        r["idle"] = [max(0.0, 1.0 - b / r["decode_s"]) for b in busy]
    state["calibration"] = {repr(k): v for k, v in calib.items()}
    div = sum(r.get("replay", {}).get("diverged", 0) for r in timed)
    if div:
        setup.notes.append(f"**{div} replayed windows found the history off the reference** (exactness broke)")
    reads = sum(r.get("replay", {}).get("mtp_reads", 0) for r in timed)
    if any(r.get("mtp_chain") for r in timed):
        setup.notes.append(f"the MTP chain ran in the MTP-named arms; the replay proposers read its drafts from the "
                           f"device {reads} times, as MtpProposer does, and offered the replayed tokens instead"
                           + (" (0 reads: this scheduler does not bind proposers to slots, so the read is not in "
                              "the timing)" if reads == 0 else ""))
    rows = summarize(timed)
    goals = compute_goals(rows)
    state["summary"], state["goals"] = rows, goals
    meta["seconds"] = time.perf_counter() - t_start
    meta["notes"] = setup.notes + [
        "total tok/s: tokens after each request's first (which its prefill made) over the decode wall (last "
        "admission to last token); admissions (prompt reads) are timed apart",
        "ms/win and idle are estimates: each compiled call counted during the timed runs was then timed alone on its "
        "stage (jax.block_until_ready, median of --calib_reps; a window's commit included); idle = 1 - sum(calls x "
        "time alone) / decode wall, so overlap and launch gaps are not observed directly"
        + ("; the draft model's calls count on the last device" if setup.draft_engine is not None else ""),
        "compile time is discounted by a warm-up pass over every arm and stream count before the timed runs; "
        "'comp' counts compiles that still happened during timing",
    ]
    md = markdown(rows, goals, meta)
    print(md)
    if out_dir:
        save()
        (out_dir / "bench_batching.md").write_text(md)
        labels = sorted({r["label"] for r in rows if r["label"]})
        title = (f"model set {args.model_set}: {setup.model}" + (" — " + ", ".join(labels) if labels else "")
                 + (" — CPU smoke run, no performance claim" if setup.smoke else ""))
        print(plot(rows, str(out_dir / "bench_batching.png"), title))
    bad = [r for r in timed if r.get("exact") is False]
    if bad:
        print(f"error: {len(bad)} run(s) did not reproduce the reference tokens", file=sys.stderr)
        return 1
    return 0


def _time_draft_call(deng, key: tuple, pos: int, reps: int) -> float:
    """Seconds of one call of the draft engine's function ``key`` (one stage), alone (median of ``reps``)."""
    import jax

    from strata_jax.sampling import RowSampling
    from strata_jax.state import Rows

    _, kind, B, T, logits = key
    pos = max(0, min(int(pos), deng.max_context - T - 2))
    toks = np.ones((B, T), np.int32)
    rows = Rows.make(list(range(B)), [pos] * B, [T] * B)
    samp = RowSampling.make([GREEDY] * B)

    def once():
        out, _ = deng.run(kind, toks, rows, samp, logits)
        jax.block_until_ready((out, deng.states))

    once()
    ts = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        once()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


if __name__ == "__main__":
    sys.exit(main())
