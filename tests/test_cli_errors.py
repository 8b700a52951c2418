"""Bad input to strata-generate: one clear line naming the problem, exit status 2, no traceback, nothing written."""

import os
import subprocess
import sys

import numpy as np
import pytest


def run_cli(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "strata_jax.run_generate", *args], capture_output=True, text=True,
                          timeout=600, env=e)


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    err = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    line = err[-1]
    assert line.startswith("error: "), line
    for n in needles:
        assert n in line, line


def _tiny_gguf(path, arch="llama", embd_type=None):
    import gguf
    from gguf import GGMLQuantizationType as Q

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_context_length(64)
    rng = np.random.default_rng(0)
    if embd_type is None:
        w.add_tensor("token_embd.weight", rng.standard_normal((16, 32)).astype(np.float32))
    else:
        # raw bytes of a block format the engine does not read (Q8_1: 40 bytes per 32 values)
        w.add_tensor("token_embd.weight", rng.integers(0, 255, (16, 40), dtype=np.uint8), raw_dtype=embd_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_missing_file(tmp_path):
    assert_clean_error(run_cli("--model", str(tmp_path / "missing.gguf"), "--prompt", "hi"), "no such file")


def test_not_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is not a model\n" * 10)
    assert_clean_error(run_cli("--model", str(p), "--prompt", "hi"), "not a GGUF file")


@pytest.mark.slow
def test_truncated(model_path, tmp_path):
    p = tmp_path / "cut.gguf"
    with open(model_path("smollm2-135m"), "rb") as f:
        p.write_bytes(f.read(50_000_000))
    assert_clean_error(run_cli("--model", str(p), "--prompt", "hi"), "truncated")


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "bert.gguf"
    _tiny_gguf(p, arch="bert")
    assert_clean_error(run_cli("--model", str(p), "--prompt", "hi"), "unsupported architecture", "bert")


def test_unsupported_block_format(tmp_path):
    from gguf import GGMLQuantizationType as Q

    p = tmp_path / "q81.gguf"
    _tiny_gguf(p, embd_type=Q.Q8_1)
    assert_clean_error(run_cli("--model", str(p), "--prompt_ids", "1,2"), "unsupported block format", "Q8_1")


def test_unknown_model_name(tmp_path):
    proc = run_cli("--model", "llama-9000", "--prompt", "hi", env={"STRATA_JAX_CACHE": str(tmp_path)})
    assert_clean_error(proc, "unknown model", "smollm2-135m")
    assert not any(tmp_path.rglob("*.partial"))


@pytest.mark.slow
def test_prompt_longer_than_context(model_path):
    proc = run_cli("--model", model_path("smollm2-135m"), "--prompt", "word " * 100, "--max_context", "16")
    assert_clean_error(proc, "longer than --max_context 16")


@pytest.mark.slow
def test_impossible_flags(model_path):
    proc = run_cli("--model", model_path("smollm2-135m"), "--prompt_ids", "1,2", "--chat")
    assert_clean_error(proc, "--chat")
    proc = run_cli("--model", model_path("smollm2-135m"), "--prompt", "a", "--prompt_ids", "1")
    assert_clean_error(proc, "exactly one of")
