"""Exactness of verify windows and batch rows on the dense path: a row of a T-row window, or of a window holding
other slots' rows, gives bit-identical logits and picks to the same row decoded alone (T = 1)."""

from pathlib import Path

import numpy as np
import pytest

from strata_jax.pipeline.solo import generate
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows

CTX = 96  # the shared engines' context (tests/conftest.py): this engine is test_spec's and test_split's too
# SmolLM2's chat prompt of the dense HF fixture: its plain decode is shared with tests/test_dense_parity.py
PROMPT = np.load(Path(__file__).parent / "fixtures" / "dense_smollm2-135m.npz")["prompt_ids"].tolist()


@pytest.mark.slow
def test_window_rows_equal_plain_decode(engine_for, plain_decode):
    eng = engine_for("smollm2-135m", max_context=CTX, n_slots=2)
    greedy = SamplingParams(0.0)
    plain = plain_decode(eng, PROMPT, 9)
    toks = plain.tokens  # toks[i] was picked from step_logits[i]
    samp = RowSampling.make([greedy])
    n = len(PROMPT)
    for T in (8, 4):  # the largest window, and a partial 8-row chunk (the shape tests/test_spec.py compiles)
        eng.prefill(0, PROMPT, greedy)
        win = np.array([toks[:T]], np.int32)  # the last accepted token + T-1 proposals (all correct)
        res = eng.window(win, Rows.make([0], [n], [T]), samp)
        logits = np.asarray(res.device_out["logits"][0])
        assert res.picks[0].tolist() == toks[1:T + 1]
        assert int(res.n_keep[0]) == T
        for t in range(T):
            assert np.array_equal(logits[t], plain.step_logits[t + 1]), (T, t)
    # a rejected proposal: row 0's pick is kept, the rest is cut
    eng.prefill(0, PROMPT, greedy)
    wrong = (toks[1] + 1) % eng.cfg.vocab_size
    res = eng.window(np.array([[toks[0], wrong, toks[2], toks[3]]], np.int32), Rows.make([0], [n], [4]), samp)
    assert int(res.n_keep[0]) == 1 and int(res.picks[0, 0]) == toks[1]


@pytest.mark.slow
def test_batch_rows_equal_solo(engine_for, plain_decode):
    eng = engine_for("smollm2-135m", max_context=CTX, n_slots=2)
    greedy = SamplingParams(0.0)
    sampled = SamplingParams(0.7, 20, 1.0, 0.0, 1234)
    other = PROMPT[:15] + [4093, 198]
    solo_a = plain_decode(eng, PROMPT, 6)
    solo_b = generate(eng, other, max_new_tokens=6, sampling=sampled, eos_ids=(), slot=1, dump_logits=True)
    # both slots in one window per step (serial batch window: one segment per slot)
    eng.prefill(0, PROMPT, greedy)
    eng.prefill(1, other, sampled)
    samp = RowSampling.make([greedy, sampled])
    a, b = [solo_a.tokens[0]], [solo_b.tokens[0]]
    for i in range(5):
        rows = Rows.make([0, 1], [len(PROMPT) + i, len(other) + i], [1, 1])
        res = eng.window(np.array([[a[-1]], [b[-1]]], np.int32), rows, samp, kind="step")
        logits = np.asarray(res.device_out["logits"][:, 0])
        assert np.array_equal(logits[0], solo_a.step_logits[i + 1])
        assert np.array_equal(logits[1], solo_b.step_logits[i + 1])
        a.append(int(res.picks[0, 0]))
        b.append(int(res.picks[1, 0]))
    assert a == solo_a.tokens[:6] and b == solo_b.tokens
