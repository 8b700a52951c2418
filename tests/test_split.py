"""Layer split: a model split over 2 or 4 CPU host devices gives the same tokens and bit-identical
logits as one device; bad splits and batches that do not fit are refused with a clear StrataError.

CI runs with XLA_FLAGS=--xla_force_host_platform_device_count=4; with fewer devices the multi-device cases skip.
"""

from pathlib import Path

import jax
import numpy as np
import pytest

from strata_jax.errors import StrataError
from strata_jax.pipeline.solo import generate
from strata_jax.sampling import SamplingParams

HYBRID = str(Path(__file__).parent / "fixtures" / "hybrid" / "qwen3next_f32.gguf")
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198]
CTX = 96
# (model, split on 2 stages, split on 4 stages); the engines are shared with tests/test_slots.py
MODELS = {"smollm2-135m": ("15", "8,15,23"), HYBRID: ("2", "1,2,3")}


def _need(k: int):
    if len(jax.devices()) < k:
        pytest.skip(f"needs {k} devices (XLA_FLAGS=--xla_force_host_platform_device_count={k})")


def _split_engine(engine_for, name, k):
    _need(k)
    if name == HYBRID and not Path(HYBRID).exists():
        pytest.fail("committed hybrid fixture is missing (experiments/parity/make_hybrid_fixtures.py makes it)")
    if k == 1:
        return engine_for(name, max_context=CTX, n_slots=2, devices=jax.devices()[:1])
    split = MODELS[name][0 if k == 2 else 1]
    return engine_for(name, max_context=CTX, n_slots=k if k > 2 else 2, layer_split=split, devices=jax.devices()[:k])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS), ids=["smollm2", "qwen3next"])
def test_split_equals_one_device(engine_for, name):
    V = 512 if name == HYBRID else 49152
    prompt = [t % V for t in PROMPT]
    ref = None
    for k in (1, 2, 4):
        eng = _split_engine(engine_for, name, k)
        assert len(eng.stages) == k
        eng.reset_slot(0)
        g = generate(eng, prompt, max_new_tokens=4, sampling=SamplingParams(0.0), dump_logits=True)
        if ref is None:
            ref = g
            continue
        assert g.tokens == ref.tokens, k
        assert np.array_equal(g.prefill_logits, ref.prefill_logits), k
        assert np.array_equal(g.step_logits, ref.step_logits), k


def test_split_more_stages_than_devices(model_path):
    from strata_jax.pipeline.engine import Engine

    with pytest.raises(StrataError, match="needs 4 devices, only 2"):
        Engine(model_path("smollm2-135m"), max_context=CTX, layer_split="8,15,23", devices=jax.devices()[:1] * 2)


@pytest.mark.parametrize("split", ["30", "0", "8,8", "15,8", "x", "-3"])
def test_split_out_of_range(model_path, split):
    from strata_jax.pipeline.engine import Engine

    with pytest.raises(StrataError, match="--layer_split"):
        Engine(model_path("smollm2-135m"), max_context=CTX, layer_split=split, devices=jax.devices()[:1] * 4)


def test_memory_report_and_refusal(model_path):
    from strata_jax.pipeline.engine import Engine
    from strata_jax.pipeline.memory import (check_batch_fits, handoff_bytes_per_row, memory_lines, memory_report,
                                            slots_that_fit, state_bytes_per_slot)

    _need(2)
    eng = Engine(model_path("smollm2-135m"), max_context=CTX, n_slots=1, layer_split="15", devices=jax.devices()[:2])
    rep = memory_report(eng)
    assert len(rep["stages"]) == 2 and all(s["slot_bytes"] > 0 for s in rep["stages"])
    assert rep["handoff_bytes_per_row"] == 4 * eng.cfg.n_embd
    lines = memory_lines(eng)
    assert "per slot" in lines[0] and "hand-off" in lines[-1]
    per = max(s["slot_bytes"] for s in rep["stages"])
    wts = max(s["weight_bytes"] for s in rep["stages"])
    limit = wts + 8 * handoff_bytes_per_row(eng) + 3 * per + per // 2  # room for 3 slots
    assert slots_that_fit(eng, limit) == 3
    check_batch_fits(eng, 3, limit)
    with pytest.raises(StrataError, match="3 slot\\(s\\) would fit"):
        check_batch_fits(eng, 4, limit)
    eng.set_slots(3)
    assert eng.n_slots == 3 and state_bytes_per_slot(eng)[0] == rep["stages"][0]["slot_bytes"]


def test_memory_in_use():
    """The run's memory for the stats line and --stats_json: the stages' devices' statistics summed, each device once
    (two stages on one GPU count it once); on a backend without statistics (CPU) the process's resident memory."""
    from types import SimpleNamespace as NS

    from strata_jax.pipeline.memory import device_memory, memory_in_use, memory_text

    class Dev:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    g = 2 ** 30
    a, b = Dev({"bytes_in_use": 3 * g, "peak_bytes_in_use": 5 * g, "bytes_limit": 8 * g}), Dev({"bytes_in_use": g})
    m = memory_in_use(NS(stages=[NS(device=a), NS(device=a), NS(device=b)]))
    assert m == {"source": "device", "bytes_in_use": 4 * g, "peak_bytes_in_use": 6 * g, "bytes_limit": 8 * g}
    assert memory_text(m) == "device memory 4.0 GiB in use, peak 6.0 of 8.0 GiB"
    assert device_memory([a, Dev(None)]) is None and device_memory([]) is None
    cpu = memory_in_use(NS(stages=[NS(device=jax.devices("cpu")[0])]))
    assert cpu["source"] == "process" and 0 < cpu["bytes_in_use"] <= cpu["peak_bytes_in_use"]
    assert memory_text(cpu).startswith("process memory (RSS) ") and memory_text(None) == ""


def test_set_slots_resizes_ple_history():
    """qwen4exp keeps each slot's PLE predecessor ids on the host: `set_slots` must resize them with the state (a
    batch on a qwen4exp file crashed in slot 1's prefill). The same prompt read into either slot gives one pick."""
    from strata_jax.pipeline.engine import Engine

    eng = Engine(str(Path(__file__).parent / "fixtures" / "hybrid" / "qwen4exp_q8_0.gguf"), max_context=CTX)
    assert eng.ple is not None and len(eng.ple.prev) == 1
    eng.set_slots(2)
    assert len(eng.ple.prev) == 2
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, eng.cfg.vocab_size, 12)]
    picks = [eng.prefill(s, prompt, SamplingParams(0.0))[0] for s in (0, 1)]
    assert picks[0] == picks[1]
