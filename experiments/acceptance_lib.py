"""Helpers of ``experiments/acceptance.ipynb``: speculative / plain runs, cached per run, and a lookup replay.

Every run is stored in a JSON cache (default ``~/.cache/strata_jax/acceptance/runs.json``, key = model, workload,
mode, T, token count), so a run made once (e.g. by ``python experiments/acceptance_lib.py`` in the background) is
not repeated when the notebook executes; delete the file to recompute everything. The notebook prints, for every
run, whether it was computed during its execution or loaded from the cache.

The recorded data of the 1.5B (`DATA`, written by ``experiments/bench_batching.py --record_acceptance``: the real
Qwen2.5-Coder-1.5B / 0.5B weights, per output position what prompt lookup and the 0.5B draft offer and how many
leading proposals match; the committed file was recorded through a numpy forward that has since been removed, its
``backend`` field says so, and a new recording runs the engine's CPU path) is read by `load_recorded`; `simulate`
replays the solo speculative loop from its per-position arrays for a window cap T, and `recorded_prompts` rebuilds
the recorded prompts with the real tokenizer (only the tokenizer is loaded) for an exact cross-check with
`replay_lookup`.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):  # the package, and bench_spec.py beside this file
    if p not in sys.path:
        sys.path.insert(0, p)

CACHE = os.environ.get("ACC_CACHE", os.path.expanduser("~/.cache/strata_jax/acceptance/runs.json"))
CTX = 1024
TINY_CTX = 256
DATA = os.path.join(HERE, "data", "acceptance_qwen2.5-coder.json")
_engines: dict = {}
_tokenizers: dict = {}


def _load_cache() -> dict:
    try:
        with open(CACHE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _save(key: str, rec: dict) -> None:
    os.makedirs(os.path.dirname(CACHE), exist_ok=True)
    c = _load_cache()
    c[key] = rec
    tmp = CACHE + ".tmp"
    with open(tmp, "w") as f:
        json.dump(c, f)
    os.replace(tmp, CACHE)


def engine(name: str, ctx: int):
    from strata_jax.models_registry import resolve_model
    from strata_jax.pipeline.engine import Engine

    if (name, ctx) not in _engines:
        path = name if name.endswith(".gguf") else resolve_model(name)
        _engines[(name, ctx)] = Engine(path, max_context=ctx)
    return _engines[(name, ctx)]


def tiny_mtp_model(fixture: str = "qwen35moe", seed: int = 0) -> str:
    """The tiny hybrid fixture + a random MTP block (written once under the cache folder)."""
    from strata_jax.testing.mtp_block import add_mtp_block

    dst = os.path.join(os.path.dirname(CACHE), f"{fixture}_q8_0_mtp{seed}.gguf")
    if not os.path.exists(dst):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        add_mtp_block(os.path.join(ROOT, "tests", "fixtures", "hybrid", f"{fixture}_q8_0.gguf"), dst, seed)
    return dst


def tokenizer_real(name: str = "qwen2.5-coder-1.5b"):
    """The tokenizer of a cached real model, read from its GGUF (no weights are loaded)."""
    from strata_jax.gguf import open_gguf
    from strata_jax.models_registry import resolve_model
    from strata_jax.tokenizer import Tokenizer

    if name not in _tokenizers:
        _tokenizers[name] = Tokenizer.from_gguf(open_gguf(str(resolve_model(name))))
    return _tokenizers[name]


def prompts_real() -> dict[str, list[int]]:
    """The prompts of the engine runs (the workloads of ``experiments/bench_spec.py``, chat template)."""
    from bench_spec import workloads

    tok = tokenizer_real("qwen2.5-coder-1.5b")
    return {name: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
            for name, text in workloads(small=False).items()}


def prompts_tiny() -> dict[str, list[int]]:
    """Token-id prompts for the tiny hybrid (vocabulary 512, no real tokenizer)."""
    rep = [11, 12, 13, 14, 15, 16, 17, 18] * 5
    return {"ids-ramp": list(range(20, 60)), "ids-repeat": rep}


def run_key(model: str, workload: str, mode: str, T: int, n_new: int, draft_model: str | None = None) -> str:
    """The cache key of a run."""
    return f"{os.path.basename(model)}|{workload}|{mode}|T{T if mode != 'plain' else 0}|n{n_new}|{draft_model or ''}"


def run(model: str, ctx: int, workload: str, ids: list[int], mode: str, T: int, n_new: int,
        draft_model: str | None = None, refresh: bool = False) -> dict:
    """One greedy generation; ``mode`` = ``plain`` | ``lookup`` | ``model`` | ``mtp``. Cached (see module doc);
    ``refresh``: compute it even when cached (and store the new run)."""
    key = run_key(model, workload, mode, T, n_new, draft_model)
    c = _load_cache()
    if key in c and not refresh:
        rec = dict(c[key])
        rec["source"] = "cache"
        return rec
    from strata_jax.pipeline.solo import generate
    from strata_jax.proposers import make_proposer
    from strata_jax.sampling import SamplingParams

    eng = engine(model, ctx)
    eos = () if model.endswith(".gguf") else eng.tokenizer.eos_ids  # tiny fixtures: no usable tokenizer
    prop = None
    if mode != "plain":
        prop = make_proposer(mode, eng, draft_model=draft_model, spec=T)
    t0 = time.perf_counter()
    g = generate(eng, list(ids), max_new_tokens=n_new, sampling=SamplingParams(), eos_ids=eos, proposer=prop,
                 spec=T if prop is not None else 0)
    rec = dict(tokens=[int(t) for t in g.tokens], stats=g.stats.as_dict(), wall_s=time.perf_counter() - t0,
               when=time.strftime("%Y-%m-%d %H:%M:%S"))
    _save(key, rec)
    rec["source"] = "computed"
    return rec


def replay_lookup(prompt: list[int], out: list[int], T: int) -> dict:
    """Windows of the solo loop with `LookupProposer` on a known greedy output (greedy acceptance depends only on
    the output and the proposer): proposed, accepted, tokens per window, accepted_at."""
    from strata_jax.proposers import LookupProposer

    lk = LookupProposer()
    seq = list(prompt) + list(out)
    n_p = len(prompt)
    hl = n_p + 1  # the first token comes from the prefill
    proposed = accepted = spec_windows = 0
    per_window, acc_at, off_at = [], [0] * (T - 1), [0] * (T - 1)
    while hl < len(seq):
        room = min(T - 1, len(seq) - hl - 1)  # the solo loop's room: the window's bonus token ends the output
        props = list(lk.propose(seq[:hl], room)) if room > 0 else []
        props = [int(p) for p in props[:room]]
        a = 0
        while a < len(props) and props[a] == seq[hl + a]:
            a += 1
        proposed += len(props)
        accepted += a
        spec_windows += bool(props)
        _tally(off_at, acc_at, len(props), a)
        per_window.append(a + 1)
        hl += a + 1
    return _window_stats(proposed, accepted, spec_windows, per_window, off_at, acc_at)


def _tally(off_at: list[int], acc_at: list[int], offered: int, accepted: int) -> None:
    """Count one window's proposals by position: the first ``offered`` were offered, the first ``accepted`` kept."""
    for i in range(offered):
        off_at[i] += 1
    for i in range(accepted):
        acc_at[i] += 1


def _window_stats(proposed, accepted, spec_windows, per_window, off_at, acc_at) -> dict:
    wt: dict[int, int] = {}
    for k in per_window:
        wt[k] = wt.get(k, 0) + 1
    n = len(per_window)
    return dict(proposed=proposed, accepted=accepted, windows=n, spec_windows=spec_windows,
                acceptance=accepted / proposed if proposed else 0.0,
                tok_per_window=sum(per_window) / n if n else 0.0,
                offered_per_window=proposed / n if n else 0.0,
                offered_at=off_at, accepted_at=acc_at, window_tokens=dict(sorted(wt.items())))


def load_recorded(path: str = DATA) -> dict:
    """The recorded acceptance of the real 1.5B + 0.5B (see the module doc)."""
    with open(path) as f:
        return json.load(f)


def simulate(offered: list[int], accepted: list[int], T: int) -> dict:
    """The solo speculative loop (`strata_jax.pipeline.solo`) from recorded per-position arrays.

    Position ``p`` (0-based) of the arrays: the history ends after output token ``p``; ``offered[p]`` proposals
    (recorded with room for up to 7) and ``accepted[p]`` of them, leading, equal the reference tokens ``p+1, ...``.
    The output has ``len(offered) + 1`` tokens, the first from the prefill. A window at ``p`` offers
    ``k = min(offered[p], T - 1, room)`` (room: what still fits before the last token, as in the solo loop; a
    proposer's shorter proposal is a prefix of its longer one, so the cut is exact), keeps
    ``min(accepted[p], k) + 1`` tokens (the accepted proposals and the target's bonus token), and the next window
    starts at ``p + kept``; stops when every token is out. Returns `replay_lookup`'s statistics."""
    n = len(offered) + 1
    p = 0
    proposed = acc = spec_windows = 0
    per_window, off_at, acc_at = [], [0] * (T - 1), [0] * (T - 1)
    while p < n - 1:
        room = min(T - 1, n - 2 - p)
        k = min(int(offered[p]), room)
        a = min(int(accepted[p]), k)
        proposed += k
        acc += a
        spec_windows += k > 0
        _tally(off_at, acc_at, k, a)
        per_window.append(a + 1)
        p += a + 1
    return _window_stats(proposed, acc, spec_windows, per_window, off_at, acc_at)


def recorded_prompts(rec: dict, tok=None) -> dict[str, list[int]]:
    """The recorded prompts (request 0 of each workload), rebuilt as ``record_acceptance`` builds them
    (`strata_jax.testing.batching.workload.prompt_texts` / `encode_prompts`, chat template of the target's
    tokenizer); each is checked against the recorded prompt length."""
    from strata_jax.testing.batching import workload as B

    tok = tok or tokenizer_real(rec["target_model"])
    out = {}
    for w, wd in rec["workloads"].items():
        ids = B.encode_prompts(tok, B.prompt_texts(w, 1), tok.vocab_size)[0]
        n_rec = wd["requests"]["0"]["prompt_tokens"]
        if len(ids) != n_rec:
            raise ValueError(f"{w}: rebuilt prompt has {len(ids)} tokens, the recording {n_rec}")
        out[w] = ids
    return out


if __name__ == "__main__":
    # background pre-computation (same calls as the notebook): python experiments/acceptance_lib.py N_NEW
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    ps = prompts_real()
    # optional second argument: the runs in order, e.g. rename:model,prose:model (default: all, workload by workload)
    order = ([tuple(x.split(":")) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else
             [(w, m) for w in ("code", "rename", "prose") for m in ("model", "lookup", "plain")])
    for w, mode in order:
        r = run("qwen2.5-coder-1.5b", CTX, w, ps[w], mode, 4, n, "qwen2.5-coder-0.5b" if mode == "model" else None)
        print(w, mode, r["source"], round(r["wall_s"], 1), r["stats"]["accepted"], r["stats"]["proposed"], flush=True)
    mtp = tiny_mtp_model()
    for w, ids in prompts_tiny().items():
        for mode in ("plain", "mtp"):
            r = run(mtp, TINY_CTX, w, ids, mode, 4, 48)
            print("tiny", w, mode, r["source"], round(r["wall_s"], 1), flush=True)
