"""Typed metadata reads (strata_jax.gguf.metadata) and the config layer on wrong-typed or out-of-range keys: one line
``<file>: key 'X' must be ...``, never a traceback. Malformed files are built from the tiny hybrid fixtures by
tests/gguf_edit.py; the CLI is checked end to end on a few."""

import types

import gguf_edit as E
import numpy as np
import pytest

from strata_jax.errors import StrataError
from strata_jax.gguf import open_gguf
from strata_jax.gguf.metadata import get_array, get_bool, get_float, get_int, get_str
from strata_jax.models.registry import config_from_gguf

FIX = E.FIXTURE.parent


def _g(**md):
    return types.SimpleNamespace(metadata=md, path="m.gguf")


def _err(fn, *a, **k) -> str:
    with pytest.raises(StrataError) as e:
        fn(*a, **k)
    return str(e.value)


def test_get_int():
    g = _g(a=7, b=True, c=7.0, d="7", e=np.array([7]), big=2**64 - 1)
    assert get_int(g, "a", min=1, max=7) == 7 and type(get_int(g, "a")) is int
    assert get_int(g, "missing", -1, min=0) == -1  # the default is not checked
    assert _err(get_int, g, "missing") == "m.gguf: GGUF metadata lacks 'missing'"
    for k in "bcde":
        assert _err(get_int, g, k).startswith(f"m.gguf: key '{k}' must be an integer (got ")
    assert _err(get_int, g, "a", min=8) == "m.gguf: key 'a' must be an integer >= 8 (got 7)"
    assert _err(get_int, g, "big", min=1, max=2**32) == \
        f"m.gguf: key 'big' must be an integer in [1, {2**32}] (got {2**64 - 1})"


def test_get_float():
    g = _g(a=1e-6, i=10000, nan=float("nan"), inf=float("-inf"), s="1", b=False, neg=-1.0)
    assert get_float(g, "a", positive=True) == 1e-6
    assert get_float(g, "i") == 10000.0 and type(get_float(g, "i")) is float
    for k in ("nan", "inf", "s", "b"):
        assert f"key '{k}' must be a finite number" in _err(get_float, g, k)
    assert "must be a finite number > 0 (got -1.0)" in _err(get_float, g, "neg", positive=True)
    assert "in [0, 1]" in _err(get_float, g, "i", min=0, max=1)


def test_get_str_and_bool():
    g = _g(s="gpt2", i=3, b=True, one=1)
    assert get_str(g, "s", choices=("gpt2", "llama")) == "gpt2"
    assert "must be a string (got 3)" in _err(get_str, g, "i")
    assert "must be one of 'llama' (got 'gpt2')" in _err(get_str, g, "s", choices=("llama",))
    assert get_bool(g, "b") is True and get_bool(g, "missing", False) is False
    assert "must be a bool (got 1)" in _err(get_bool, g, "one")


def test_get_array():
    u64 = np.array([1, 2**63 - 1], np.uint64)
    g = _g(i=np.array([0, 0, 4], np.int32), f=np.array([1.0, np.nan], np.float32), s=["a", "b"], u=u64,
           b=np.array([True, False]), bi=np.array([1, 0], np.int32), bad=np.array([2], np.int32), m=[1, "a"],
           nested=[np.array([1]), np.array([2])], scalar=3, big=[2**70])
    assert get_array(g, "i", of="int", length=3, min=0) == (0, 0, 4)
    assert get_array(g, "u", of="int", max=2**63 - 1) == (1, 2**63 - 1)
    assert get_array(g, "s", of="str", min_length=2) == ("a", "b")
    assert get_array(g, "b", of="bool") == (True, False) == get_array(g, "bi", of="bool")
    assert get_array(g, "i", of="int", as_numpy=True) is g.metadata["i"]
    assert get_array(g, "missing", None, of="int") is None
    assert "key 'f' must be an array of finite numbers" in _err(get_array, g, "f", of="float")
    assert "must be an array of 2 integers (got array of 3 int32)" in _err(get_array, g, "i", of="int", length=2)
    assert "must be an array of at least 4 integers" in _err(get_array, g, "i", of="int", min_length=4)
    assert "must be an array of integers >= 1" in _err(get_array, g, "i", of="int", min=1)
    assert "must be an array of bools" in _err(get_array, g, "bad", of="bool")
    for k in ("s", "m", "nested", "scalar", "big"):
        assert f"key '{k}' must be an array of integers" in _err(get_array, g, k, of="int")
    assert "must be an array of strings" in _err(get_array, g, "i", of="str")


# ---------------------------------------------------------------- the config builder on edited fixtures

A = "qwen3next."
X = "qwen4exp."

CASES = [
    # (fixture, key, GGUF type, value, expected message after "key 'X' must be ")
    ("qwen3next", A + "block_count", E.STR, "abc", "an integer in [1, "),
    ("qwen3next", A + "block_count", E.U64, 2**63, "an integer in [1, "),
    ("qwen3next", A + "block_count", E.ARR, (E.U32, [4]), "an integer in [1, "),
    ("qwen3next", A + "attention.head_count", E.U32, 0, "an integer in [1, "),
    ("qwen3next", A + "attention.head_count", E.F32, 4.0, "an integer in [1, "),
    ("qwen3next", A + "attention.head_count_kv", E.U32, 3, "a divisor of qwen3next.attention.head_count (4)"),
    ("qwen3next", A + "embedding_length", E.I32, -256, "an integer in [1, "),
    ("qwen3next", A + "attention.layer_norm_rms_epsilon", E.F32, float("nan"), "a finite number in (0, 1.0]"),
    ("qwen3next", A + "attention.layer_norm_rms_epsilon", E.F32, 0.0, "a finite number in (0, 1.0]"),
    ("qwen3next", A + "attention.layer_norm_rms_epsilon", E.F32, 2.0, "a finite number in (0, 1.0]"),
    ("qwen3next", A + "rope.freq_base", E.F64, float("inf"), "a finite number > 0"),
    ("qwen3next", A + "rope.freq_base", E.STR, "1e7", "a finite number > 0"),
    ("qwen3next", A + "rope.dimension_count", E.U32, 17, "even and at most the head width (64)"),
    ("qwen3next", A + "rope.dimension_count", E.U32, 128, "even and at most the head width (64)"),
    ("qwen3next", A + "context_length", E.U32, 0, "an integer in [1, "),
    ("qwen3next", A + "expert_count", E.BOOL, True, "an integer in [1, "),
    ("qwen3next", A + "expert_used_count", E.U32, 9, "an integer in [1, 8]"),
    ("qwen3next", A + "ssm.inner_size", E.U32, 250, "a multiple of qwen3next.ssm.time_step_rank (8)"),
    ("qwen3next", A + "ssm.group_count", E.U32, 3, "a divisor of qwen3next.ssm.time_step_rank (8)"),
    ("qwen3next", A + "ssm.time_step_rank", E.U32, 0, "an integer in [1, "),
    ("qwen3next", A + "attention.recurrent_layers", E.ARR, (E.BOOL, [True, False]), "an array of at least 4 bools"),
    ("qwen3next", A + "attention.recurrent_layers", E.ARR, (E.STR, ["a"] * 4), "an array of at least 4 bools"),
    ("qwen3next", A + "attention.recurrent_layers", E.ARR, (E.I32, [1, 2, 0, 0]), "an array of at least 4 bools"),
    ("qwen3next", "tokenizer.ggml.tokens", E.ARR, (E.I32, list(range(512))), "an array of strings"),
    ("qwen3next", "tokenizer.ggml.eos_token_id", E.STR, "</s>", "an integer in [-1, "),
    ("qwen4exp", X + "ple.layers", E.ARR, (E.I32, [7]), "an array of integers in [0, 3]"),
    ("qwen4exp", X + "ple.ngram_size", E.U32, 1, "an integer in [2, 64]"),
    ("qwen4exp", X + "ple.layer_multipliers", E.ARR, (E.U64, [3, 5]), "an array of 3 integers in [1, "),
    ("qwen4exp", X + "ple.layer_multipliers", E.ARR, (E.U64, [3, 2**63, 5]), "an array of 3 integers in [1, "),
    ("qwen4exp", X + "ple.head_vocab_sizes", E.ARR, (E.U64, [67] * 15), "an array of 16 integers in [1, "),
    ("qwen4exp", X + "ple.head_vocab_sizes", E.ARR, (E.U64, [0] * 16), "an array of 16 integers in [1, "),
    ("qwen4exp", X + "ple.head_offsets", E.ARR, (E.U64, [10**6] * 16), "inside the "),
    ("qwen4exp", X + "attention.compress_ratios", E.ARR, (E.F32, [0.0] * 4), "an array of at least 4 integers"),
    ("qwen4exp", X + "hyper_connection.count", E.U32, 0, "an integer in [1, "),
    ("qwen4exp", X + "attention.indexer.top_k", E.I32, -1, "an integer in [1, "),
]


@pytest.mark.parametrize("fixture,key,vtype,value,needle", CASES, ids=[f"{c[1]}={c[3]!r}"[:60] for c in CASES])
def test_config_refuses(tmp_path, fixture, key, vtype, value, needle):
    lay = E.layout(FIX / f"{fixture}_q8_0.gguf")
    p = tmp_path / "bad.gguf"
    p.write_bytes(E.replace_kv(lay, key, E.kv(key, vtype, value)))
    with pytest.raises(StrataError) as e:
        config_from_gguf(open_gguf(p))
    assert str(e.value).startswith(f"{p}: key '{key}' must be {needle}"), str(e.value)


@pytest.mark.parametrize("key", [A + "block_count", A + "ssm.state_size", A + "expert_count"])
def test_config_missing_key(tmp_path, key):
    lay = E.layout(FIX / "qwen3next_q8_0.gguf")
    p = tmp_path / "bad.gguf"
    p.write_bytes(E.drop_kv(lay, key))
    with pytest.raises(StrataError, match=f"GGUF metadata lacks '{key}'"):
        config_from_gguf(open_gguf(p))


def test_config_attention_interval(tmp_path):
    """Without attention.recurrent_layers the layer kinds come from full_attention_interval (checked then)."""
    lay = E.layout(FIX / "qwen3next_q8_0.gguf")
    p = tmp_path / "ok.gguf"
    p.write_bytes(E.drop_kv(lay, A + "attention.recurrent_layers"))
    assert config_from_gguf(open_gguf(p)).layer_recurrent == (True, True, True, False)
    lay2 = E.layout(p)
    p2 = tmp_path / "bad.gguf"
    p2.write_bytes(E.replace_kv(lay2, A + "full_attention_interval", E.kv(A + "full_attention_interval", E.U32, 0)))
    with pytest.raises(StrataError, match="key 'qwen3next.full_attention_interval' must be an integer in .1, "):
        config_from_gguf(open_gguf(p2))


def test_config_accepts_int_typed_floats(tmp_path):
    """A float key written as an integer (some converters write rope.freq_base as uint32) reads as that float."""
    lay = E.layout(FIX / "qwen3next_q8_0.gguf")
    p = tmp_path / "ok.gguf"
    p.write_bytes(E.replace_kv(lay, A + "rope.freq_base", E.kv(A + "rope.freq_base", E.U32, 5_000_000)))
    cfg = config_from_gguf(open_gguf(p))
    assert cfg.rope_theta == 5e6 and cfg.n_layer == 4 and cfg.layer_recurrent == (True, True, True, False)


# ---------------------------------------------------------------- the tokenizer's keys

def _tiny_tokenizer_file(path, **override):
    import gguf

    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
          "tokenizer.ggml.tokens": ["a", "b", "ab", "Ġ", "Ġab"], "tokenizer.ggml.merges": ["a b", "Ġ ab"]}
    kv.update(override)
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in kv.items():
        if isinstance(v, tuple):  # (GGUF type, value)
            w.add_key_value(k, v[1], v[0])
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_gguf(path)


@pytest.mark.parametrize("key,value,needle", [
    ("tokenizer.ggml.tokens", [1, 2, 3], "an array of strings"),
    ("tokenizer.ggml.merges", [1.5], "an array of strings"),
    ("tokenizer.ggml.token_type", [1, 1], "an array of 5 integers in [0, 255]"),
    ("tokenizer.ggml.model", (6, 2.0), "a string"),
    ("tokenizer.ggml.add_bos_token", "yes", "a bool"),
    ("tokenizer.ggml.eos_token_id", "</s>", "an integer"),
])
def test_tokenizer_refuses(tmp_path, key, value, needle):
    from strata_jax.tokenizer import Tokenizer

    g = _tiny_tokenizer_file(tmp_path / "t.gguf", **{key: value})
    with pytest.raises(StrataError, match=f"key '{key}' must be {needle.replace('[', '.').replace(']', '.')}"):
        Tokenizer.from_gguf(g)


def test_tokenizer_still_builds(tmp_path):
    from strata_jax.tokenizer import Tokenizer

    t = Tokenizer.from_gguf(_tiny_tokenizer_file(tmp_path / "t.gguf", **{"tokenizer.ggml.add_bos_token": (7, True)}))
    assert t.encode("ab ab") == [2, 4] and t.add_bos


# ---------------------------------------------------------------- the command line

def test_cli_malformed_files(tmp_path):
    """A negative alignment (read as data start 0 before: the CLI exited 0 and generated) and a string block
    count: one error line, exit 2, no traceback."""
    from test_cli_errors import assert_clean_error, run_cli

    lay = E.layout()
    p = tmp_path / "align.gguf"
    p.write_bytes(E.add_kv(lay, E.kv("general.alignment", E.I32, -2**31)))
    assert_clean_error(run_cli("--model", str(p), "--prompt_ids", "1,2"), "general.alignment",
                       "must be a positive power of two")
    p = tmp_path / "blocks.gguf"
    p.write_bytes(E.replace_kv(lay, A + "block_count", E.kv(A + "block_count", E.STR, "abc")))
    assert_clean_error(run_cli("--model", str(p), "--prompt_ids", "1,2"), "key 'qwen3next.block_count' must be")
