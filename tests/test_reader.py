"""The streaming GGUF header parser against gguf.GGUFReader, its speed on Gemma 3's 262k-token header, and its
errors on bad files."""

import os
import time

import numpy as np
import pytest

from strata_jax.errors import StrataError
from strata_jax.gguf import open_gguf


@pytest.mark.slow
def test_header_matches_gguf_reader(model_path):
    import gguf

    path = model_path("smollm2-135m")
    ours = open_gguf(path)
    ref = gguf.GGUFReader(path)
    assert ours.architecture == "llama"
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        o = ours.tensors[t.name]
        assert o.qtype == t.tensor_type
        assert o.shape == tuple(int(x) for x in reversed(t.shape.tolist()))
        assert o.offset == int(t.data_offset) and o.nbytes == int(t.n_bytes)
        np.testing.assert_array_equal(ours.tensor_bytes(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    assert ours.metadata["llama.block_count"] == 30
    assert ours.metadata["tokenizer.ggml.tokens"][:3] == [bytes(ref.fields["tokenizer.ggml.tokens"].parts[i]).decode()
                                                         for i in ref.fields["tokenizer.ggml.tokens"].data[:3]]


@pytest.mark.slow
def test_gemma3_header_under_two_seconds(model_path):
    path = model_path("gemma3-270m")
    t0 = time.perf_counter()
    g = open_gguf(path)
    dt = time.perf_counter() - t0
    assert len(g.metadata["tokenizer.ggml.tokens"]) == 262144
    assert dt < 2.0, f"header took {dt:.2f} s"


def test_missing_file(tmp_path):
    with pytest.raises(StrataError, match="no such file"):
        open_gguf(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + os.urandom(100))
    with pytest.raises(StrataError, match="not a GGUF file"):
        open_gguf(p)


@pytest.mark.slow
def test_truncated(model_path, tmp_path):
    src = model_path("smollm2-135m")
    for cut in (1000, os.path.getsize(src) - 4096):
        p = tmp_path / f"t{cut}.gguf"
        with open(src, "rb") as f:
            p.write_bytes(f.read(cut))
        with pytest.raises(StrataError, match="truncated"):
            open_gguf(p)
