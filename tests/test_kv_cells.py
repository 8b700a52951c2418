"""bfloat16 K/V cells (``--kv_dtype bfloat16``): on a CPU held as uint16 bit patterns, written and read back as the
values rounded to bfloat16 (ml_dtypes' rounding is the reference), and a real model decodes with them as with float32 cells
up to that rounding."""

from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from strata_jax.state import Rows, kv_view, kv_zeros, write_cells

CTX = 96
PROMPT = np.load(Path(__file__).parent / "fixtures" / "dense_smollm2-135m.npz")["prompt_ids"].tolist()


def test_bf16_cells_hold_the_rounded_values():
    rng = np.random.default_rng()
    n_slots, max_context, H, D = 3, 10, 2, 8
    cache = kv_zeros((n_slots, max_context + 1, H, D), jnp.bfloat16)
    assert cache.dtype == jnp.uint16
    vals = (rng.standard_normal((2, 4, H, D)) * 10).astype(np.float32)
    rows = Rows.make([2, 0], [3, 8], [4, 2])  # slot 0's rows 2, 3 (positions 10, 11) go to the spare cell
    got = np.asarray(kv_view(write_cells(cache, rows, jnp.asarray(vals), max_context)).astype(jnp.float32))
    want = np.zeros((n_slots, max_context + 1, H, D), np.float32)
    want[2, 3:7] = vals[0].astype(ml_dtypes.bfloat16).astype(np.float32)
    want[0, 8:10] = vals[1, :2].astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(got[:, :max_context], want[:, :max_context])
    assert np.array_equal(got[1], want[1])  # another slot's cells untouched
    f32 = write_cells(kv_zeros((n_slots, max_context + 1, H, D), jnp.float32), rows, jnp.asarray(vals), max_context)
    assert f32.dtype == jnp.float32 and np.array_equal(np.asarray(f32)[2, 3:7], vals[0])


@pytest.mark.slow
def test_bf16_kv_decode_follows_f32(model_path, engine_for, plain_decode):
    """SmolLM2 with bfloat16 cells: the same greedy tokens as float32 cells, logits within bfloat16's rounding."""
    from strata_jax.pipeline.engine import Engine
    from strata_jax.pipeline.solo import generate
    from strata_jax.sampling import SamplingParams

    ref = plain_decode(engine_for("smollm2-135m", max_context=CTX, n_slots=2), PROMPT, 6)
    eng = Engine(model_path("smollm2-135m"), max_context=CTX, kv_dtype=jnp.bfloat16)
    assert all(leaf.dtype == jnp.uint16 for st in eng.states for kv in st["kv"] for leaf in kv)
    got = generate(eng, PROMPT, max_new_tokens=6, sampling=SamplingParams(0.0), eos_ids=(), dump_logits=True)
    assert got.tokens == ref.tokens[:6]
    for ours, theirs in ((got.prefill_logits, ref.prefill_logits), (got.step_logits, ref.step_logits[:6])):
        rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
        assert 0 < rel < 2e-2, rel  # the prompt reads its own K/V back from the cells too: rounded, not equal
