"""Weights dequantized at load (`Engine(weights="f32")`, the CPU default) give bit for bit the logits of weights kept
in their block formats (`weights="blocks"`, dequantized inside every matmul: the GPU layout): prefill, plain steps
and a verify window's rows, on a dense model (SmolLM2, Q4_1/Q6_K... blocks) and a hybrid (qwen4exp Q8_0 fixture)."""

from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q

from strata_jax.errors import StrataError
from strata_jax.pipeline.engine import Engine
from strata_jax.pipeline.solo import generate
from strata_jax.sampling import RowSampling, SamplingParams
from strata_jax.state import Rows

CTX = 64
HYBRID = str(Path(__file__).parent / "fixtures" / "hybrid" / "qwen4exp_q8_0.gguf")


@pytest.mark.parametrize("name", ["smollm2-135m", HYBRID], ids=["smollm2", "qwen4exp"])
def test_f32_at_load_equals_blocks(model_path, name):
    path = name if name.endswith(".gguf") else model_path(name)
    engines = {w: Engine(path, max_context=CTX, weights=w) for w in ("blocks", "f32")}
    assert engines["f32"].weights == "f32" and engines["blocks"].weights == "blocks"
    qtypes = {w: {p.qtype for p in _linears(e)} for w, e in engines.items()}
    assert qtypes["f32"] <= {Q.F32, Q.F16, Q.BF16} and qtypes["blocks"] - {Q.F32, Q.F16, Q.BF16}
    V = engines["f32"].cfg.vocab_size
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, V, 10)]
    gens = {w: generate(e, prompt, max_new_tokens=5, sampling=SamplingParams(0.0), eos_ids=(), dump_logits=True)
            for w, e in engines.items()}
    assert gens["f32"].tokens == gens["blocks"].tokens
    np.testing.assert_array_equal(gens["f32"].prefill_logits, gens["blocks"].prefill_logits)
    np.testing.assert_array_equal(gens["f32"].step_logits, gens["blocks"].step_logits)
    # a 4-row verify window on the block weights: every row equals its plain step (row exactness of that path)
    eng, toks = engines["blocks"], gens["blocks"].tokens
    eng.prefill(0, prompt, SamplingParams(0.0))
    res = eng.window(np.array([toks[:4]], np.int32), Rows.make([0], [len(prompt)], [4]),
                     RowSampling.make([SamplingParams(0.0)]))
    logits = np.asarray(res.device_out["logits"][0])
    for t in range(4):
        np.testing.assert_array_equal(logits[t], gens["blocks"].step_logits[t + 1])


def _linears(engine):
    from flax import nnx

    from strata_jax.layers.linear import QLinear

    return [m for st in engine.stages for _, m in nnx.iter_graph(st.module) if isinstance(m, QLinear)]


def test_unknown_weights_mode(model_path):
    with pytest.raises(StrataError, match="weights='f16'"):
        Engine(model_path("smollm2-135m"), max_context=CTX, weights="f16")
