"""The batch-slot exactness harness: every request's tokens equal its solo decode.

`workload` builds a staggered set of requests (admissions one round apart, one cancellation, more requests than
slots once there are), `solo_tokens` decodes a request alone, and `check` runs the requests through
`strata_jax.pipeline.scheduler.BatchScheduler` in one mode and compares every finished request with its solo
tokens (a cancelled request must be a prefix of them). Used by tests/test_slots.py, test_mtp_proposer.py,
test_draft_hybrid.py and ``experiments/batch_exactness.py`` (the command-line run, e.g. on GPUs).
"""

from __future__ import annotations

import copy

from strata_jax.pipeline.engine import Engine
from strata_jax.pipeline.scheduler import BatchScheduler, Request
from strata_jax.pipeline.solo import generate
from strata_jax.sampling import SamplingParams

GREEDY = SamplingParams(0.0)


def seeded(seed: int) -> SamplingParams:
    """The seeded sampler of the workloads: temperature 0.7, top_k 20, draws keyed by ``seed``."""
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


def make_prompts(n: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of 16-40 tokens; each ends by repeating its start, so prompt lookup has something to propose."""
    base = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]
    out = []
    for i in range(n):
        body = [(t * (1 + i // 4) + 7 * i) % vocab for t in base[:10 + 2 * (i % 4)]]
        out.append(body + body[:6])
    return out


def check(engine: Engine, mode_res, reqs: list[Request], solo: dict, proposer_factory=None, spec_min_p=0.0):
    """Run ``reqs`` in ``mode_res``'s mode; returns (results, list of mismatch descriptions, scheduler)."""
    sch = BatchScheduler(engine, mode_res, proposer_factory=proposer_factory, spec_min_p=spec_min_p)
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
