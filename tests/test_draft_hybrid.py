"""Draft models with recurrent state (`strata_jax.proposers.DraftModelProposer` on a hybrid GGUF): the draft runs
its own verify windows and commits only the rows the target kept, so its GDN / conv state follows every verdict.

Target: the tiny qwen3next fixture in float32; draft: the same model re-quantized to Q8_0 (tests/fixtures/hybrid/),
so many drafts are accepted and many rejected, at every depth of a window.

* Solo, greedy and seeded: the speculative output is the plain output token for token; windows end rejected at
  draft 1, at draft 2 and fully accepted; rounds in which the proposer steps aside (it proposes nothing, and the
  next round's tail no longer fits in one window beside the drafts) lie between rounds whose drafts were accepted;
  after rejections and after those rounds the drafts are the ones a fresh proposer makes from the whole history
  (had a rejected draft stayed in the draft's recurrent state, they would differ).
* Batch slots (piped MTP on a 2-stage split, serial batch MTP on one device; a staggered admission, a cancellation
  and slot reuse): each request drafts in its own slot of the draft engine and decodes its solo tokens.

Engines are shared through ``engine_for``: the target is the 2-stage split engine of tests/test_slots.py (whose
[1, 3] windows these tests run too), one draft engine serves every test here.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from strata_jax.pipeline.groups import resolve_groups
from strata_jax.pipeline.solo import generate
from strata_jax.proposers import DraftModelProposer, Proposer
from strata_jax.sampling import SamplingParams
from strata_jax.testing import exactness as bx

FIX = Path(__file__).parent / "fixtures" / "hybrid"
TARGET, DRAFT = str(FIX / "qwen3next_f32.gguf"), str(FIX / "qwen3next_q8_0.gguf")
CTX = 96
SPEC = 3  # the window cap: the token + 2 drafts (the windows of piped MTP with 2 proposals)
SEEDED = SamplingParams(0.7, 20, 1.0, 0.0, 3)


def _engines(engine_for):
    """(target, draft): the target on a 2-stage split when there are 2 devices (the engine of tests/test_slots.py,
    whose windows [1, 3] are the ones these tests run), else on one device; one draft engine with 2 slots."""
    for p in (TARGET, DRAFT):
        if not Path(p).exists():
            pytest.fail(f"committed fixture {Path(p).name} is missing (experiments/parity/make_hybrid_fixtures.py)")
    if len(jax.devices()) >= 2:
        target = engine_for(TARGET, max_context=CTX, n_slots=2, layer_split="2", devices=jax.devices()[:2])
    else:
        target = engine_for(TARGET, max_context=CTX, n_slots=2)
    return target, engine_for(DRAFT, max_context=CTX, n_slots=2)


def _prompt(n=24, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


class _Logged(Proposer):
    """Forwards to a proposer and logs every round: (history, drafts, emitted tokens); (None, None, emitted) for a
    round in which the policy did not ask it."""

    name = "model"

    def __init__(self, inner):
        super().__init__()
        self.inner, self.engine = inner, inner.engine
        self.rounds, self._asked = [], None

    def propose(self, history_ids, max_n, min_p=0.0):
        d = self.inner.propose(history_ids, max_n, min_p)
        self.last_probs = self.inner.last_probs
        self._asked = (list(history_ids), list(d))
        return d

    def observe(self, kept_tokens):
        h, d = self._asked or (None, None)
        self._asked = None
        self.rounds.append((h, d, list(kept_tokens)))

    def reset(self):
        super().reset()
        self.inner.reset()
        self.rounds = []

    def bind(self, slot):
        self.inner.bind(slot)


class _Aside:
    """A `SpecPolicy` stand-in that steps aside on the given rounds (1-based) and asks the proposer otherwise."""

    def __init__(self, rounds):
        self.aside, self.rounds, self.stepped_aside = set(rounds), 0, 0

    def use_proposer(self):
        self.rounds += 1
        use = self.rounds not in self.aside
        self.stepped_aside += not use
        return use

    def record(self, *args, **kwargs):
        pass

    def table(self):
        return {}


@pytest.mark.slow
@pytest.mark.parametrize("samp", [SamplingParams(0.0), SEEDED], ids=["greedy", "seeded"])
def test_hybrid_draft_solo_exact_and_rolled_back(engine_for, samp):
    target, deng = _engines(engine_for)
    prompt = _prompt()
    n = 28
    plain = generate(target, prompt, max_new_tokens=n, sampling=samp).tokens
    prop = DraftModelProposer(deng, slot=0, window=SPEC)
    assert prop.recurrent
    log = _Logged(prop)
    g = generate(target, prompt, max_new_tokens=n, sampling=samp, proposer=log, spec=SPEC,
                 policy=_Aside({3, 7, 8}))
    assert g.tokens == plain
    st = g.stats
    assert 0 < st.accepted < st.proposed, (st.accepted, st.proposed)
    # the verdict of every round with a full window of drafts: rejected at draft 1, at draft 2, or all accepted
    full = [len(kept) - 1 for h, d, kept in log.rounds[:-1] if d is not None and len(d) == SPEC - 1]
    assert set(full) == set(range(SPEC)), full
    # a round that proposed nothing, between rounds whose drafts were (partly) accepted
    accepted = [i for i, (h, d, kept) in enumerate(log.rounds) if d and len(kept) > 1]
    asides = [i for i, (h, d, kept) in enumerate(log.rounds) if d is None]
    assert any(accepted[0] < i < accepted[-1] for i in asides), (accepted, asides)
    # the draft's state after a verdict is its state after the kept prefix: after rejected drafts and after rounds
    # it sat out, a fresh proposer (slot 1) that reads the whole history drafts the same tokens
    after = [r for prev, r in zip(log.rounds, log.rounds[1:])
             if r[1] and (prev[1] is None or len(prev[2]) - 1 < len(prev[1]))]
    assert len(after) >= 3, log.rounds
    fresh = DraftModelProposer(deng, slot=1, window=SPEC)
    for h, d, _ in after[:3]:  # a fresh read costs a prefill: three of them
        fresh.reset()
        assert fresh.propose(h, len(d)) == d, (len(h), d)


@pytest.mark.slow
def test_hybrid_draft_batch_slots(engine_for):
    """Piped MTP (groups of one slot, 2 proposals per window; serial batch MTP on one device) with draft-model
    proposals; request 0 greedy, 1 seeded and cancelled, 2 seeded; every request decodes its solo tokens."""
    target, deng = _engines(engine_for)
    shared = DraftModelProposer(deng, window=SPEC)
    made = []

    def factory():
        made.append(shared.fork())
        return made[-1]

    prompts = [_prompt(12 + 2 * i, seed=20 + i) for i in range(3)]
    reqs = bx.workload(prompts, 10, sampled=True)
    reqs[0].sampling = bx.GREEDY
    solo = {i: bx.solo_tokens(target, r) for i, r in enumerate(reqs)}
    flags = dict(piped_mtp=SPEC - 1) if len(target.stages) > 1 else dict(batch_mtp=True)
    res = resolve_groups(target.n_slots, len(target.stages), **flags)
    assert res.mode in ("piped_mtp", "batch_mtp"), res.message
    results, bad, sch = bx.check(target, res, reqs, solo, factory)
    assert not bad, bad
    assert [r.stop_reason for r in results].count("max tokens") == 2 and results[1].stop_reason == "cancelled"
    prop, acc = sum(r.proposed for r in results), sum(r.accepted for r in results)
    assert 0 < acc < prop, (acc, prop)
    # each request drafted in the draft slot of its own target slot, and two requests were active at once
    assert [p.slot for p in made] == [r.slot for r in results] and len({p.slot for p in made}) == 2
    assert all(p.engine is deng for p in made)
    assert all(p.draft_calls > 0 for p, r in zip(made, results) if r.stop_reason == "max tokens")
