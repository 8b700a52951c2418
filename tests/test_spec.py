"""Speculative decoding on one sequence: whatever the proposals, the output is token
for token what plain decoding gives, greedy and seeded-sampled, on real models.

Engines come from the session cache (``engine_for``) with two slots: slot 0 holds the sequence, slot 1 the
self-drafting model's sequence, so the draft reuses the target's compiled functions. They are the same engines as in
tests/test_windows.py, test_dense_parity.py and test_split.py (context ``CTX``, two slots).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from strata_jax.errors import StrataError
from strata_jax.pipeline.solo import generate
from strata_jax.proposers import (DraftModelProposer, LookupProposer, ScriptedProposer, SpecPolicy,
                                  check_same_tokenizer, make_proposer)
from strata_jax.sampling import SamplingParams

CTX = 96  # the shared engines' context (tests/conftest.py)
N = 16
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.7, top_k=20, seed=1234)
MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b"]
FIXTURES = Path(__file__).parent / "fixtures"


def _engine(engine_for, name):
    return engine_for(name, max_context=CTX, n_slots=2)


def _prompt(name):
    """The dense HF fixture's chat prompt: its greedy plain decode is shared with tests/test_dense_parity.py, and its
    continuation repeats prompt text (chat markers, the question's words), so prompt lookup proposes."""
    return np.load(FIXTURES / f"dense_{name}.npz")["prompt_ids"].tolist()


def _plain(engine_for, plain_decode, name, samp, n=N):
    """(prompt ids, the plain decode's first ``n`` tokens)."""
    ids = _prompt(name)
    return ids, plain_decode(_engine(engine_for, name), ids, n, samp).tokens[:n]


def _spec(engine_for, name, samp, proposer, spec=4, n=N, **kw):
    return generate(_engine(engine_for, name), _prompt(name), max_new_tokens=n, sampling=samp, proposer=proposer,
                    spec=spec, **kw)


def _oracle(ids, plain, wrong_at=None):
    """A scripted proposer that proposes the known plain continuation (wrong from draft index ``wrong_at`` on)."""
    full = list(ids) + list(plain)

    def fn(history, max_n):
        n = len(history)
        assert history == full[:n], "the history must be the plain output"
        out = full[n:n + max_n]
        if wrong_at is not None:
            out = [t if i < wrong_at else (t + 1) % 1000 for i, t in enumerate(out)]
        return out

    return ScriptedProposer(fn, "oracle")


# every (proposer, sampling) pair on SmolLM2; on Qwen2.5-Coder (the second dense family) both proposers greedy: its
# plain reference is test_dense_parity's decode, and the sampler (tests/test_sampling.py) does not depend on the model
CASES = [(name, samp, kind) for name in MODELS for samp in (GREEDY, SAMPLED) for kind in ("lookup", "model")
         if name == MODELS[0] or samp.greedy]


@pytest.mark.parametrize("name,samp,kind", CASES,
                         ids=[f"{k}-{'greedy' if s.greedy else 'sampled'}-{n}" for n, s, k in CASES])
def test_same_output_as_plain(engine_for, plain_decode, name, samp, kind):
    ids, plain = _plain(engine_for, plain_decode, name, samp)
    eng = _engine(engine_for, name)
    prop = LookupProposer() if kind == "lookup" else DraftModelProposer(eng, eng, slot=1, window=4)
    g = _spec(engine_for, name, samp, prop, policy=SpecPolicy() if kind == "lookup" else None)
    assert g.tokens == plain
    st = g.stats
    assert st.generated == len(plain) and st.spec == 4 and st.proposer == kind
    assert st.accepted <= st.proposed and sum(st.accepted_at) == st.accepted and sum(st.offered_at) == st.proposed
    assert sum(k * v for k, v in st.window_tokens.items()) == len(plain) - 1
    assert st.spec_windows > 0  # windows with proposals ran (not only one-row steps)
    if kind == "model":
        assert prop.slot == 1  # drafting on the target engine: the solo loop's bind keeps the draft's own slot
        if samp.greedy:  # a model drafting greedily for itself is always right
            assert st.accepted == st.proposed
            assert st.tokens_per_window > 2.5


@pytest.mark.parametrize("name", MODELS[:1])
def test_full_none_partial_acceptance(engine_for, plain_decode, name):
    ids, plain = _plain(engine_for, plain_decode, name, GREEDY)
    full = _spec(engine_for, name, GREEDY, _oracle(ids, plain), spec=4)
    assert full.tokens == plain
    assert full.stats.accepted == full.stats.proposed > 0
    assert full.stats.windows == -(-(len(plain) - 1) // 4)  # 4 tokens per window, the last one cut at max tokens
    none = _spec(engine_for, name, GREEDY, _oracle(ids, plain, wrong_at=0), spec=4)
    assert none.tokens == plain
    assert none.stats.accepted == 0 and none.stats.windows == len(plain) - 1
    part = _spec(engine_for, name, GREEDY, _oracle(ids, plain, wrong_at=1), spec=4)
    assert part.tokens == plain
    assert part.stats.accepted_at[0] == part.stats.spec_windows and part.stats.accepted_at[1] == 0
    assert part.stats.window_tokens.get(2, 0) >= part.stats.windows - 1


@pytest.mark.parametrize("name", MODELS[:1])
def test_eos_and_stop_inside_a_window(engine_for, plain_decode, name):
    ids, plain = _plain(engine_for, plain_decode, name, GREEDY)
    # pretend a token in the middle of the plain output is EOS: plain and speculative both end there, EOS included
    j = 9
    eos = {plain[j]}
    first = plain.index(plain[j])
    want = generate(_engine(engine_for, name), ids, max_new_tokens=N, sampling=GREEDY, eos_ids=eos).tokens
    assert want == plain[:first + 1]
    seen = []
    g = _spec(engine_for, name, GREEDY, _oracle(ids, plain), spec=4, eos_ids=eos, on_token=seen.append)
    assert g.tokens == want and g.stats.stop_reason == "eos"
    assert seen == want[:-1]  # EOS is not streamed
    # a stop condition three tokens in, inside a fully accepted window
    g = _spec(engine_for, name, GREEDY, _oracle(ids, plain), spec=4, stop=lambda toks: len(toks) >= 3)
    assert g.tokens == plain[:3] and g.stats.stop_reason == "stop string"


def test_context_end(engine_for):
    name = MODELS[0]
    eng = _engine(engine_for, name)
    ids = _prompt(name)
    prompt = ids * ((CTX - 12) // len(ids)) + ids[:(CTX - 12) % len(ids)]
    assert len(prompt) == CTX - 12
    want = generate(eng, prompt, max_new_tokens=40, sampling=GREEDY)
    assert want.stats.stop_reason == "context end"
    g = generate(eng, prompt, max_new_tokens=40, sampling=GREEDY, proposer=LookupProposer(), spec=4)
    assert g.tokens == want.tokens and g.stats.stop_reason == "context end"


def test_spec_min_p_and_dump_logits(engine_for, plain_decode):
    name = MODELS[0]
    eng = _engine(engine_for, name)
    ids, plain = _plain(engine_for, plain_decode, name, GREEDY)
    prop = DraftModelProposer(eng, eng, slot=1, window=4)
    g = _spec(engine_for, name, GREEDY, prop, spec=4, spec_min_p=0.9, dump_logits=True)
    assert g.tokens == plain
    assert g.step_logits.shape[0] == len(plain)
    assert list(g.step_logits.argmax(-1)) == plain
    assert g.stats.proposed <= 3 * g.stats.spec_windows


def test_refusals(engine_for):
    small, coder = _engine(engine_for, MODELS[0]), _engine(engine_for, MODELS[1])
    with pytest.raises(StrataError, match="different tokenizer"):
        check_same_tokenizer(coder, small)
    with pytest.raises(StrataError, match="different tokenizer"):
        DraftModelProposer(small, coder)
    with pytest.raises(StrataError, match="MTP"):
        make_proposer("mtp", small)
    with pytest.raises(StrataError, match="draft_model"):
        make_proposer("model", small)
    with pytest.raises(StrataError, match="2..8"):
        generate(small, [1, 2, 3], max_new_tokens=2, proposer=LookupProposer(), spec=9)


def test_lookup_proposer_unit():
    p = LookupProposer()
    h = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    assert p.propose(h, 7) == [4, 5, 6, 7, 8] and p.last_match == 3
    assert p.propose(h, 2) == [4, 5]
    assert p.propose(h + [4, 5, 9, 9, 2, 3], 7) == []  # (9, 2, 3) never occurred before
    # the longest match wins over the most recent one
    h = [7, 1, 2, 3, 40, 0, 9, 1, 2, 3, 50, 0, 7, 1, 2, 3]
    assert p.propose(h, 3) == [40, 0, 9] and p.last_match == 4
    # ties go to the most recent occurrence; an unrelated history rebuilds the index
    assert p.propose([5, 1, 2, 3, 7, 0, 1, 2, 3, 8, 1, 2, 3], 4) == [8, 1, 2, 3]
    assert LookupProposer(min_match=5).propose([1, 2, 3, 4, 9, 2, 3, 4], 3) == []


def test_policy_steps_aside_when_windows_do_not_pay():
    pol = SpecPolicy(probe_every=10, warmup=2)
    uses = []
    for i in range(40):
        use = pol.use_proposer()
        uses.append(use)
        if use:
            pol.record("spec", 4, 1, 0.004)  # a window of 4 rows that keeps 1 token in 4 ms
        else:
            pol.record("plain", 1, 1, 0.001)  # a step: 1 token in 1 ms
    assert pol.stepped_aside > 30 and sum(uses) < 10  # warm-up, then only probes
    pol = SpecPolicy(warmup=2, probe_every=8)
    for i in range(2):
        assert pol.use_proposer()
        pol.record("spec", 4, 3, 0.002)  # 3 tokens in 2 ms
    assert not pol.use_proposer()  # one plain step to compare
    pol.record("plain", 1, 1, 0.001)
    pol.record("plain", 1, 1, 5.0, compiled=True)  # compiling rounds are not measured
    assert sum(pol.use_proposer() for _ in range(4)) == 4  # rounds 4..7
    assert not pol.use_proposer()  # round 8 probes the losing mode
    table = pol.table()
    assert table["spec"]["tok_per_ms"] == pytest.approx(1.5) and table["plain"]["tok_per_ms"] == pytest.approx(1.0)
