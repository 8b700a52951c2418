"""Host-side PLE row ids (qwen4exp): chunking-invariance and a regression against HF.

The expected ids below were checked equal to HF transformers 5.24 ``Qwen4ExpTextNGramEmbedding`` (its
``ngram_embedding`` input) for the same tokens, with the tiny fixture's config (vocab 512, base 64, seed 1234,
eos 511); the multipliers equal HF ``layer_multipliers``.
"""

import numpy as np

from strata_jax.layers.ple import ple_head_sizes, ple_multipliers, ple_row_ids


def _setup():
    m = ple_multipliers(512, 3, 0, 1234)
    s, o = ple_head_sizes(64, 16, 0)
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 511, 40)
    toks[[5, 17, 18]] = 511
    return m, s, o, toks


def test_multipliers_match_hf():
    m, _, _, _ = _setup()
    np.testing.assert_array_equal(m, [4295158889763781, 17440218147737327, 1270917961434445])


def test_row_ids_chunk_invariant():
    m, s, o, toks = _setup()
    kw = dict(eos=511, mult=m, sizes=s, offsets=o, heads_per_ngram=8)
    whole = ple_row_ids(np.array([511, 511]), toks, **kw)
    for cut in (1, 6, 18, 19, 25):
        a = ple_row_ids(np.array([511, 511]), toks[:cut], **kw)
        prev = np.concatenate([[511, 511], toks[:cut]])[-2:]
        b = ple_row_ids(prev, toks[cut:], **kw)
        np.testing.assert_array_equal(np.concatenate([a, b]), whole)
    assert whole.min() >= 0 and (whole < o[-1] + s[-1]).all()
