"""Exactness of verify windows and batch rows on the dense path: a row of a T-row window, or of a window holding
other slots' rows, gives bit-identical logits and picks to the same row decoded alone (T = 1)."""

import numpy as np
import pytest

from strata_jax.pipeline.solo import generate
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649,
          47, 2, 198, 1, 520, 9531, 198]


@pytest.mark.slow
def test_window_rows_equal_plain_decode(engine_for):
    eng = engine_for("smollm2-135m", max_context=96, n_slots=2)
    greedy = SamplingParams(0.0)
    plain = generate(eng, PROMPT, max_new_tokens=9, sampling=greedy, eos_ids=(), dump_logits=True)
    toks = plain.tokens  # toks[i] was picked from step_logits[i]
    samp = RowSampling.make([greedy])
    n = len(PROMPT)
    for T in (8, 3):
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
    res = eng.window(np.array([[toks[0], wrong, toks[2]]], np.int32), Rows.make([0], [n], [3]), samp)
    assert int(res.n_keep[0]) == 1 and int(res.picks[0, 0]) == toks[1]


@pytest.mark.slow
def test_batch_rows_equal_solo(engine_for):
    eng = engine_for("smollm2-135m", max_context=96, n_slots=2)
    greedy = SamplingParams(0.0)
    sampled = SamplingParams(0.7, 20, 1.0, 0.0, 1234)
    other = PROMPT[:15] + [4093, 198]
    solo_a = generate(eng, PROMPT, max_new_tokens=6, sampling=greedy, eos_ids=(), dump_logits=True)
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
    assert a == solo_a.tokens and b == solo_b.tokens
