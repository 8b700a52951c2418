"""Tests for strata_jax.tokenizer on the real SmolLM2, Qwen2.5-Coder and Gemma 3 GGUF files.

Reference ids come from the models' HF tokenizers (and agree with llama.cpp); Gemma 3's encoding is also checked
against a plain-Python copy of llama.cpp's llm_tokenizer_spm (highest-score bigram first, byte fallback).
"""

import time

import pytest

from strata_jax.errors import StrataError, UnsupportedError
from strata_jax.gguf import open_gguf
from strata_jax.models_registry import fetch_model
from strata_jax.tokenizer import StreamDecoder, Tokenizer

SENTENCE = "The capital of France is Paris."
REFERENCE_IDS = {
    "smollm2-135m": [504, 3575, 282, 4649, 314, 7042, 30],
    "qwen2.5-coder-0.5b": [785, 6722, 315, 9625, 374, 12095, 13],
    "gemma3-270m": [2, 818, 5279, 529, 7001, 563, 9079, 236761],
}
MODELS = list(REFERENCE_IDS)

ROUND_TRIP = [
    SENTENCE,
    "def f(x):\n    if x > 0:\n\treturn [1, 2]  # tab, spaces\n\n\n    else:\r\n        pass\n",
    "café déjà vu, naïve Zoë",
    "👍🏽🎉 emoji 🙂",
    "中文日本語한국어 テスト，标点。",
    "  leading and trailing spaces  ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "year 2024: 12345 items, 3.14159",
    "rare: \U00013000 \u0800\uffff \U000e0041",  # byte-fallback tokens in Gemma
    "",
]

_CACHE: dict[str, Tokenizer] = {}


def tok(name: str) -> Tokenizer:
    if name not in _CACHE:
        _CACHE[name] = Tokenizer.from_gguf(open_gguf(fetch_model(name, quiet=True)))
    return _CACHE[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_reference_ids(name):
    t = tok(name)
    assert t.encode(SENTENCE) == REFERENCE_IDS[name]
    assert t.decode(REFERENCE_IDS[name], skip_special=True) == SENTENCE


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(name, text):
    t = tok(name)
    ids = t.encode(text, add_bos=False)
    assert t.decode(ids) == text
    if not any(t.is_special(i) for i in ids):  # with the file's BOS, dropped again by skip_special
        assert t.decode(t.encode(text), skip_special=True) == text
    # streaming gives the same text, never a replacement character for a split multi-byte sequence
    sd = t.stream_decoder()
    parts = [sd.feed(i) for i in ids] + [sd.flush()]
    assert "".join(parts) == text
    assert not any("\ufffd" in p for p in parts)


@pytest.mark.slow
def test_stream_decoder_holds_back_partial_utf8():
    t = tok("smollm2-135m")
    ids = t.encode("👍🏽")  # byte-level BPE splits these emoji mid-character
    assert len(ids) > 2
    sd = StreamDecoder(t)
    parts = [sd.feed(i) for i in ids]
    assert parts[0] == ""  # the first token is an incomplete UTF-8 sequence
    assert "".join(parts) + sd.flush() == "👍🏽"
    # an unfinished sequence at the end comes out as U+FFFD on flush
    sd = StreamDecoder(t)
    assert sd.feed(ids[0]) == "" and sd.flush() == "\ufffd"
    g = tok("gemma3-270m")
    ids = g.encode("\U00013000", add_bos=False)  # four <0xXX> byte tokens
    assert len(ids) == 4
    sd = g.stream_decoder()
    assert [sd.feed(i) for i in ids] == ["", "", "", "\U00013000"]


@pytest.mark.slow
def test_special_tokens_map_to_ids():
    s = tok("smollm2-135m")
    assert s.encode("<|im_start|>user\nhi<|im_end|>")[0] == s.token_to_id("<|im_start|>") == 1
    assert s.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    q = tok("qwen2.5-coder-0.5b")
    assert q.encode("<|im_start|>x<|im_end|>") == [151644, q.encode("x")[0], 151645]
    assert q.encode("<tool_call>")[0] == 151657  # user-defined token
    g = tok("gemma3-270m")
    ids = g.encode("<start_of_turn>user\nhi<end_of_turn>\n")
    assert ids[:3] == [2, 105, g.token_to_id("user")] and 106 in ids
    assert g.encode("<bos>hi") == [2, g.token_to_id("hi")]  # no second BOS
    assert g.encode("", add_bos=True) == [2] and g.encode("hi", add_bos=False) == [g.token_to_id("hi")]
    assert g.decode(ids, skip_special=True) == "user\nhi\n"
    assert g.decode(ids).startswith("<bos><start_of_turn>user\n")


@pytest.mark.slow
def test_vocab_properties():
    s, q, g = tok("smollm2-135m"), tok("qwen2.5-coder-0.5b"), tok("gemma3-270m")
    assert (s.vocab_size, s.bos_id, s.eos_id, s.add_bos) == (49152, 1, 2, False)
    assert s.eos_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert (q.vocab_size, q.eos_id, q.add_bos) == (151936, 151645, False)
    assert q.eos_ids == {151643, 151645}
    assert (g.vocab_size, g.bos_id, g.eos_id, g.add_bos) == (262144, 2, 1, True)
    assert g.eos_ids == {1, 106}  # <eos>, <end_of_turn>
    assert s.id_to_token(504) == "The" and s.token_to_id("ĠParis") == 7042
    assert g.id_to_token(9079) == "▁Paris" and g.token_to_id("no such token") is None
    with pytest.raises(IndexError):
        s.id_to_token(49152)


_SCORES: dict[str, object] = {}


def _spm_reference(t: Tokenizer, text: str) -> list[int]:
    """llama.cpp llm_tokenizer_spm, plainly: merge the best-scoring adjacent pair (leftmost on ties) until none."""
    if "gemma3-270m" not in _SCORES:
        _SCORES["gemma3-270m"] = open_gguf(fetch_model("gemma3-270m", quiet=True)).metadata["tokenizer.ggml.scores"]
    scores = _SCORES["gemma3-270m"]
    syms = list(text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(syms) - 1):
            j = t.token_to_id(syms[i] + syms[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        j = t.token_to_id(s)
        out.extend([j] if j is not None else [t.token_to_id(f"<0x{b:02X}>") for b in s.encode()])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("text", [
    SENTENCE, "Hello world! How are you doing today?", "The naïve café's crème brûlée, déjà vu.",
    "unbelievably antidisestablishmentarianism", "x=1;y=f(x)+g[2]", "东京是日本的首都。", "👍🏽🎉 ok",
    "\u0800\uffff",
])
def test_gemma_matches_llama_cpp_spm(text):
    g = tok("gemma3-270m")
    assert g.encode(text, add_bos=False) == _spm_reference(g, text)


@pytest.mark.slow
def test_gemma_build_is_fast():
    g = open_gguf(fetch_model("gemma3-270m", quiet=True))
    t0 = time.perf_counter()
    Tokenizer.from_gguf(g)
    assert time.perf_counter() - t0 < 10.0


Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_chat_template_smollm2():
    t = tok("smollm2-135m")
    assert t.chat_template_source == "gguf"
    assert t.apply_chat_template(Q) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert t.apply_chat_template(Q, add_generation_prompt=False).endswith("France?<|im_end|>\n")
    ids = t.encode(t.apply_chat_template(Q))
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> ... two <|im_end|>


@pytest.mark.slow
def test_chat_template_qwen():
    t = tok("qwen2.5-coder-0.5b")
    assert t.apply_chat_template(Q) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    sys_q = [{"role": "system", "content": "Be brief."}] + Q
    assert t.apply_chat_template(sys_q).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


@pytest.mark.slow
def test_chat_template_gemma_fallback():
    t = tok("gemma3-270m")
    assert t.chat_template_source == "fallback:gemma"
    assert t.apply_chat_template(Q) == \
        "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    conv = [{"role": "system", "content": "Be brief."}, Q[0], {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And Italy?"}]
    assert t.apply_chat_template(conv, add_generation_prompt=False) == (
        "<start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n<start_of_turn>user\nAnd Italy?<end_of_turn>\n")
    ids = t.encode(t.apply_chat_template(Q))
    assert ids[:3] == [2, 105, t.token_to_id("user")] and ids[-3:] == [105, t.token_to_id("model"), 107]


def _write_gguf(path, **kv):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in kv.items():
        w.add_key_value(k, v, gguf.GGUFValueType.STRING if isinstance(v, str) else gguf.GGUFValueType.ARRAY,
                        sub_type=None if isinstance(v, str) else gguf.GGUFValueType.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_gguf(path)


def test_no_tokenizer(tmp_path):
    with pytest.raises(StrataError, match="no usable tokenizer"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "none.gguf", **{"tokenizer.ggml.model": "none"}))
    with pytest.raises(StrataError, match="no usable tokenizer"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "empty.gguf"))


def test_unsupported_model(tmp_path):
    g = _write_gguf(tmp_path / "bert.gguf", **{"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(UnsupportedError, match="'bert'"):
        Tokenizer.from_gguf(g)


def test_unsupported_pre_tokenizer(tmp_path):
    g = _write_gguf(tmp_path / "pre.gguf", **{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery",
                                              "tokenizer.ggml.tokens": ["a", "b", "ab"],
                                              "tokenizer.ggml.merges": ["a b"]})
    with pytest.raises(UnsupportedError, match="'mystery'"):
        Tokenizer.from_gguf(g)


def test_tiny_gpt2_and_chatml_fallback(tmp_path):
    g = _write_gguf(tmp_path / "tiny.gguf", **{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                                               "tokenizer.ggml.tokens": ["a", "b", "ab", "Ġ", "Ġab"],
                                               "tokenizer.ggml.merges": ["a b", "Ġ ab"]})
    t = Tokenizer.from_gguf(g)
    assert t.encode("ab ab") == [2, 4] and t.decode([2, 4]) == "ab ab"
    assert t.chat_template_source == "fallback:chatml"
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
