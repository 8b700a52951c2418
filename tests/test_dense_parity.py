"""Dense families against HF transformers run on the dequantized GGUF (fixtures made by
experiments/parity/make_dense_fixtures.py): prompt logits within 1e-3 relative in f32, the first 32 greedy tokens
identical; and the end-to-end chat answer of SmolLM2."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from strata_jax.models_registry import registry

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_logits_and_greedy_match_hf(name, engine_for, plain_decode):
    fx = np.load(os.path.join(FIXTURES, f"dense_{name}.npz"))
    assert str(fx["model_sha256"]) == registry()[name]["sha256"]
    eng = engine_for(name, max_context=96, n_slots=2)  # the engine of tests/test_spec.py (and test_windows.py)
    prompt = fx["prompt_ids"].tolist()
    # the greedy decode (no EOS) with logits; test_spec and test_windows compare against the same decode
    gen = plain_decode(eng, prompt, 32)
    assert len(gen.tokens) == 32
    # prompt logits at the fixture's positions, on the reference's top-16 ids
    for i, p in enumerate(fx["prompt_positions"]):
        ours = gen.prefill_logits[p, fx["prompt_topk_ids"][i]]
        assert _rel(ours, fx["prompt_topk_values"][i]) < 1e-3, (name, int(p))
    assert _rel(gen.prefill_logits[-1], fx["last_logits"]) < 1e-3
    assert gen.tokens == fx["greedy_ids"].tolist()
    for i in range(32):
        ours = gen.step_logits[i, fx["decode_topk_ids"][i]]
        assert _rel(ours, fx["decode_topk_values"][i]) < 1e-3, (name, i)


@pytest.mark.slow
def test_chat_answer_end_to_end(model_path, tmp_path):
    """The CLI answers a chat question with the real model's greedy text; the second run of the same command reads
    its compiled programs from the persistent compilation cache (<--cache_dir>/xla), says so, and answers the
    same."""
    cache = tmp_path / "xla"
    for run in range(2):
        proc = subprocess.run([sys.executable, "-m", "strata_jax.cli.generate", "--model", model_path("smollm2-135m"),
                               "--chat", "--prompt", "What is the capital of France?", "--max_new_tokens", "24",
                               "--max_context", "128", "--cache_dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip() == "The capital of France is Paris."
        stats = proc.stderr.strip().splitlines()[-1]
        assert "tok/s" in stats and "stop: eos" in stats
        got = re.search(r"XLA cache: (\d+) read, (\d+) compiled and written", stats)
        assert got, stats
        read, written = int(got.group(1)), int(got.group(2))
        if run == 0:
            entries = set(os.listdir(cache))
            assert entries and read == 0 and written >= 2, (entries, stats)  # the prefill chunk and the step
        else:
            assert read >= 2 and written == 0, stats
            compiling = [ln for ln in proc.stderr.splitlines() if ln.startswith(("compiling ", "compiled "))]
            assert all(ln.endswith("(read from the XLA cache)") for ln in compiling), compiling
    assert set(os.listdir(cache)) == entries  # the second run compiled nothing new
