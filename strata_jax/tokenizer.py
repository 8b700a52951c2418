"""Text <-> token ids for GGUF models, built from the file's own tokenizer metadata.

No torch, no transformers, no network: the vocabulary, merges, scores and token types stored in the GGUF header
(``tokenizer.ggml.*``) are turned into a HF ``tokenizers`` pipeline (the Rust library does the splitting and the BPE
merging); decoding and chat templates are done here.

Supported ``tokenizer.ggml.model`` values (names as in llama.cpp's ``src/llama-vocab.cpp``):

``gpt2``
  byte-level BPE with ranked merges (``tokenizer.ggml.merges``). The text is first split by the pre-tokenizer
  regexes that llama.cpp uses for ``tokenizer.ggml.pre`` (`PRE_TOKENIZERS`; e.g. ``smollm`` = split digits, then the
  GPT-2 regex; ``qwen2`` = Qwen2's regex), each piece is mapped byte -> unicode as GPT-2 does, then merged.

``llama``
  SentencePiece BPE with scores (llama.cpp's ``llm_tokenizer_spm``): spaces become ``▁`` (plus a leading ``▁`` when
  ``tokenizer.ggml.add_space_prefix``), the text starts as single characters, and the adjacent pair whose
  concatenation is the vocabulary token with the highest score is merged until none is left; characters not in the
  vocabulary become ``<0xXX>`` byte tokens. Files carry no merges for this model, so `_merges_from_scores` derives
  them the way HF's ``SentencePieceExtractor`` does: every split of a normal token into two vocabulary tokens is a
  merge, ranked by the token's score (highest first). Lowest rank first is then exactly highest score first.

In both, control tokens (``<|im_start|>``, ``<start_of_turn>``, ``<bos>`` ...) and user-defined tokens (Gemma's runs of
spaces/newlines/tabs and HTML tags, Qwen's ``<tool_call>``) are matched in the raw text before anything else and map
to their own ids, as llama.cpp's ``tokenizer_st_partition`` does with ``parse_special``.

Reference ids for "The capital of France is Paris." (checked in tests/test_tokenizer.py): SmolLM2
``[504, 3575, 282, 4649, 314, 7042, 30]``, Qwen2.5 ``[785, 6722, 315, 9625, 374, 12095, 13]``, Gemma 3
``[2, 818, 5279, 529, 7001, 563, 9079, 236761]`` (BOS 2 added because the file sets ``add_bos_token``).
"""

from __future__ import annotations

import codecs
import datetime
import json
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from strata_jax.errors import StrataError, UnsupportedError
from strata_jax.gguf.metadata import get_array, get_bool, get_int, get_str

if TYPE_CHECKING:
    from strata_jax.gguf import GGUFFile

# tokenizer.ggml.token_type values (llama.h llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# The GPT-2 pre-tokenizer regex, without its final `|\s+` alternative, as llama.cpp writes it.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (regexes applied in turn, each splitting every piece with matches kept as pieces;
# ignore_merges: a piece that is itself a vocabulary token is not merged). From llama.cpp llama-vocab.cpp
# (llama_vocab::impl::load and the llm_tokenizer_bpe constructor).
_DEFAULT_BPE = ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"], False)
_SMOLLM = ([r"\p{N}", _GPT2_RE], False)
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    "default": _DEFAULT_BPE,
    "gpt-2": ([_GPT2_RE], False),
    "smollm": _SMOLLM, "starcoder": _SMOLLM, "refact": _SMOLLM, "command-r": _SMOLLM, "codeshell": _SMOLLM,
    "exaone": _SMOLLM, "minerva-7b": _SMOLLM,
    "qwen2": ([_QWEN2_RE], False), "qwen2.5": ([_QWEN2_RE], False), "qwen-2.5": ([_QWEN2_RE], False),
    "deepseek-r1-qwen": ([_QWEN2_RE], False),
    "llama3": ([_LLAMA3_RE], True), "llama-v3": ([_LLAMA3_RE], True), "llama-bpe": ([_LLAMA3_RE], True),
}

# Tokens that end a turn when present in the vocabulary (llama.cpp's end-of-generation list, llama-vocab.cpp).
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                      "<EOT>", "_<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")

# Fallback chat templates, used when the file has no tokenizer.chat_template.
# Gemma: HF's Gemma 3 template (system text prefixed to the first user turn, "assistant" -> "model", content
# trimmed) without its leading bos_token, which `Tokenizer.encode` adds.
GEMMA_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + (message['content'] | trim)"
    " + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# Everything else: ChatML.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (openai/gpt-2 encoder.py; llama.cpp unicode.cpp)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _merges_from_scores(tokens: list[str], types: np.ndarray, scores: np.ndarray,
                        vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece-BPE scoring (as HF ``SentencePieceExtractor`` builds them).

    Every normal token that splits into two vocabulary tokens gives one merge per split, ranked by the token's score,
    highest first (stable, so ties keep vocabulary order). Gemma 3 (262,144 tokens) gives ~514k merges in ~2 s.

    Args:
      tokens: the vocabulary, index = id.
      types: token types (int array, same length).
      scores: token scores (float array, same length).
      vocab: token -> id.

    Returns:
      (left, right) pairs, best first.
    """
    normal = np.nonzero(types == TOKEN_NORMAL)[0]
    order = normal[np.argsort(-scores[normal], kind="stable")].tolist()
    merges: list[tuple[str, str]] = []
    add = merges.append
    for i in order:
        t = tokens[i]
        for k in range(1, len(t)):
            a = t[:k]
            if a in vocab:
                b = t[k:]
                if b in vocab:
                    add((a, b))
    return merges


class Tokenizer:
    """Encode text to token ids and back, for one GGUF model (build it with `Tokenizer.from_gguf`).

    Attributes:
      model: ``tokenizer.ggml.model`` (``"gpt2"`` or ``"llama"``).
      pre: ``tokenizer.ggml.pre`` (``None`` if absent).
      vocab_size: number of tokens (``len(tokenizer.ggml.tokens)``).
      bos_id: ``tokenizer.ggml.bos_token_id`` or ``None``.
      eos_id: ``tokenizer.ggml.eos_token_id`` or ``None``.
      eos_ids: ids that end generation: ``eos_id``, ``tokenizer.ggml.eot_token_id``/``eom_token_id`` when set, and
        any of `END_OF_TURN_TOKENS` (``<|im_end|>``, ``<end_of_turn>``, ``<|endoftext|>`` ...) in the vocabulary.
      add_bos: whether `encode` prepends ``bos_id`` by default (``tokenizer.ggml.add_bos_token``; when absent, True
        for ``llama`` and False for ``gpt2``, llama.cpp's defaults).
      add_space_prefix: (``llama`` only) whether a ``▁`` is put before the text (``tokenizer.ggml.add_space_prefix``,
        default True as in llama.cpp); `decode` then drops the leading space again.
      chat_template: the jinja2 source `apply_chat_template` renders.
      chat_template_source: ``"gguf"`` (``tokenizer.chat_template``), ``"fallback:gemma"`` or ``"fallback:chatml"``.
      hf: the underlying ``tokenizers.Tokenizer``.
    """

    def __init__(self, *, hf, tokens: list[str], types: np.ndarray, vocab: dict[str, int], model: str,
                 pre: str | None, bos_id: int | None, eos_id: int | None, eos_ids: set[int], add_bos: bool,
                 add_space_prefix: bool, chat_template: str, chat_template_source: str):
        self.hf = hf
        self._tokens = tokens
        self._types = types
        self._vocab = vocab
        self.model = model
        self.pre = pre
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.add_space_prefix = add_space_prefix
        self.chat_template = chat_template
        self.chat_template_source = chat_template_source
        self._pieces: dict[int, bytes] = {}
        self._template = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, g: "GGUFFile") -> "Tokenizer":
        """Build the tokenizer stored in GGUF file ``g``.

        Args:
          g: an open GGUF file (`strata_jax.gguf.open_gguf`); only ``g.metadata`` is read.

        Returns:
          The `Tokenizer`.

        Raises:
          StrataError: the file has no usable tokenizer (``tokenizer.ggml.model`` missing or ``"none"``, no token
            list, a ``llama`` model without scores, a ``gpt2`` model without merges); callers can fall back to
            token ids given directly (the CLI's ``--prompt_ids``).
          UnsupportedError: a ``tokenizer.ggml.model`` (e.g. ``bert``, ``t5``, ``rwkv``) or ``gpt2``
            ``tokenizer.ggml.pre`` this module does not implement; the message names it.
        """
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

        where = getattr(g, "path", "GGUF file")
        model = get_str(g, "tokenizer.ggml.model", None)
        tokens = get_array(g, "tokenizer.ggml.tokens", None, of="str")
        if model is None or model == "none" or not tokens:
            raise StrataError(f"{where}: the file has no usable tokenizer (tokenizer.ggml.model={model!r}, "
                              f"{len(tokens or [])} tokens); pass token ids directly (--prompt_ids)")
        if model not in ("gpt2", "llama"):
            raise UnsupportedError(f"{where}: tokenizer model {model!r} is not supported (supported: gpt2 = "
                                   "byte-level BPE, llama = SentencePiece BPE); pass token ids directly (--prompt_ids)")
        tokens = list(tokens)
        n = len(tokens)
        types = get_array(g, "tokenizer.ggml.token_type", None, of="int", length=n, min=0, max=255, as_numpy=True)
        types = np.full(n, TOKEN_NORMAL, np.int32) if types is None else types.astype(np.int32)
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != n:  # duplicate strings: the first id wins, as in llama.cpp's token_to_id
            vocab = {}
            for i, t in enumerate(tokens):
                vocab.setdefault(t, i)
        pre = get_str(g, "tokenizer.ggml.pre", None)
        add_space_prefix = False

        if model == "gpt2":
            merges = get_array(g, "tokenizer.ggml.merges", None, of="str")
            if not merges:
                raise StrataError(f"{where}: the file has no usable tokenizer (gpt2 model without "
                                  "tokenizer.ggml.merges); pass token ids directly (--prompt_ids)")
            key = pre or "default"
            if key not in PRE_TOKENIZERS:
                raise UnsupportedError(f"{where}: pre-tokenizer {key!r} (tokenizer.ggml.pre) is not supported; "
                                       f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
            regexes, ignore_merges = PRE_TOKENIZERS[key]
            pairs = []
            for m in merges:
                p = m.find(" ", 1)  # llama.cpp: the first space after position 0 separates the halves
                if p > 0:
                    pairs.append((m[:p], m[p + 1:]))
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            hf.decoder = decoders.ByteLevel()
            add_bos_default = False
        else:
            scores = get_array(g, "tokenizer.ggml.scores", None, of="float", as_numpy=True)
            if scores is None or len(scores) != n:
                raise StrataError(f"{where}: the file has no usable tokenizer (llama model without "
                                  "tokenizer.ggml.scores); pass token ids directly (--prompt_ids)")
            merges = _merges_from_scores(tokens, types, np.asarray(scores, np.float32), vocab)
            unk_id = get_int(g, "tokenizer.ggml.unknown_token_id", None)
            unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < n else None
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
            add_space_prefix = get_bool(g, "tokenizer.ggml.add_space_prefix", True)
            norm = [normalizers.Replace(" ", "▁")]
            if add_space_prefix:
                norm.insert(0, normalizers.Prepend("▁"))
            hf.normalizer = normalizers.Sequence(norm)
            hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                           + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
            add_bos_default = True

        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i in np.nonzero((types == TOKEN_CONTROL) | (types == TOKEN_UNKNOWN))[0].tolist()]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i in np.nonzero(types == TOKEN_USER_DEFINED)[0].tolist()]
        if special:
            hf.add_special_tokens(special)
        if user:
            hf.add_tokens(user)

        def tid(key):
            v = get_int(g, key, None)
            return v if v is not None and 0 <= v < n else None

        bos_id, eos_id = tid("tokenizer.ggml.bos_token_id"), tid("tokenizer.ggml.eos_token_id")
        eos_ids = {i for i in (eos_id, tid("tokenizer.ggml.eot_token_id"), tid("tokenizer.ggml.eom_token_id"))
                   if i is not None}
        eos_ids |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}

        template = get_str(g, "tokenizer.chat_template", None)
        if template is not None and template.strip():
            source = "gguf"
        elif get_str(g, "general.architecture", "").startswith("gemma"):
            template, source = GEMMA_TEMPLATE, "fallback:gemma"
        else:
            template, source = CHATML_TEMPLATE, "fallback:chatml"

        add_bos = get_bool(g, "tokenizer.ggml.add_bos_token", add_bos_default)
        return cls(hf=hf, tokens=tokens, types=types, vocab=vocab, model=model, pre=pre, bos_id=bos_id,
                   eos_id=eos_id, eos_ids=eos_ids, add_bos=add_bos,
                   add_space_prefix=add_space_prefix, chat_template=template, chat_template_source=source)

    # ------------------------------------------------------------------ vocabulary

    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary string ``token`` (as stored in the file, e.g. ``"Ġthe"``, ``"▁the"``), or None."""
        return self._vocab.get(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of ``token_id``. Raises IndexError outside ``[0, vocab_size)``."""
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")
        return self._tokens[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (``<bos>``, ``<|im_end|>``, ...), the ones ``skip_special`` drops."""
        return int(self._types[token_id]) == TOKEN_CONTROL

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``.

        Control and user-defined tokens written in the text (``<|im_start|>``, ``<start_of_turn>``) map to their ids.

        Args:
          text: the text.
          add_bos: prepend ``bos_id``; None = the file's default (`add_bos`). No second BOS is added when the text
            already starts with the BOS token (e.g. a chat template that writes ``bos_token``).

        Returns:
          list of int ids.
        """
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos and self.bos_id is not None and not (ids and ids[0] == self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes token ``token_id`` stands for (llama.cpp ``token_to_piece``).

        gpt2: normal tokens are mapped back through GPT-2's byte table; ``llama``: ``▁`` -> space and ``<0xXX>`` byte
        tokens -> that byte. Control/user-defined tokens give their text (control ones b"" with ``skip_special``).
        A piece may be part of a UTF-8 sequence (byte tokens, byte-level BPE), so join the bytes before decoding.
        """
        if skip_special and self.is_special(token_id):
            return b""
        b = self._pieces.get(token_id)
        if b is None:
            t = self.id_to_token(token_id)
            ty = int(self._types[token_id])
            if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_UNUSED):
                b = t.encode()
            elif self.model == "gpt2":
                if ty == TOKEN_NORMAL and all(c in _BYTE_DECODER for c in t):
                    b = bytes(_BYTE_DECODER[c] for c in t)
                else:
                    b = t.encode()
            elif ty == TOKEN_BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                b = bytes([int(t[3:5], 16)])
            else:
                b = t.replace("▁", " ").encode()
            self._pieces[token_id] = b
        return b

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of token ids (invalid UTF-8, e.g. a cut multi-byte character, becomes U+FFFD).

        Args:
          ids: token ids.
          skip_special: drop control tokens (BOS/EOS, ``<|im_end|>``, ...) instead of writing their text.

        Returns:
          str. For ``llama`` files with ``add_space_prefix`` one leading space is removed (the one `encode` added).
        """
        out = b"".join(self.token_bytes(int(i), skip_special) for i in ids).decode("utf-8", errors="replace")
        if self.add_space_prefix and out.startswith(" "):
            out = out[1:]
        return out

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        """A fresh `StreamDecoder` for this tokenizer."""
        return StreamDecoder(self, skip_special=skip_special)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation into the prompt text the model was trained on.

        The template (``tokenizer.chat_template``, else `GEMMA_TEMPLATE` for Gemma files, else `CHATML_TEMPLATE`) is
        rendered as HF transformers does: jinja2 ``ImmutableSandboxedEnvironment`` with ``trim_blocks``,
        ``lstrip_blocks`` and loop controls, a ``tojson`` filter that keeps non-ASCII, ``raise_exception`` and
        ``strftime_now`` globals, and the variables ``messages``, ``add_generation_prompt``, ``bos_token``,
        ``eos_token`` and ``tools`` (None), plus ``kwargs``.

        Args:
          messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
          add_generation_prompt: end with the opening of an assistant turn.
          **kwargs: further template variables.

        Returns:
          The prompt text (encode it with `encode`; control tokens in it map to their ids).

        Raises:
          StrataError: the template does not parse, or rejects the conversation (its ``raise_exception`` message).
        """
        import jinja2

        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.exceptions.TemplateError as e:
                raise StrataError(f"the chat template ({self.chat_template_source}) does not parse: {e}") from None
        variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                         bos_token=self._tokens[self.bos_id] if self.bos_id is not None else "",
                         eos_token=self._tokens[self.eos_id] if self.eos_id is not None else "")
        variables.update(kwargs)
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise StrataError(f"chat template: {e}") from None


class StreamDecoder:
    """Turns token ids, fed one at a time, into text as soon as it is complete, for printing while generating.

    Bytes of an unfinished UTF-8 sequence (an emoji split over byte tokens, a byte-level BPE token ending mid
    character) are held back until the sequence completes; invalid bytes become U+FFFD. Concatenating every `feed`
    result and `flush` gives `Tokenizer.decode` of all the ids.

    Args:
      tokenizer: the `Tokenizer`.
      skip_special: drop control tokens (see `Tokenizer.decode`).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = tokenizer.add_space_prefix  # drop one leading space, as decode does

    def _out(self, s: str) -> str:
        if self._strip and s:
            self._strip = False
            if s.startswith(" "):
                s = s[1:]
        return s

    def feed(self, token_id: int) -> str:
        """Add one token; returns the text that became complete ("" if none did)."""
        return self._out(self._dec.decode(self.tokenizer.token_bytes(int(token_id), self.skip_special)))

    def flush(self) -> str:
        """The held-back bytes (incomplete at the end: U+FFFD), and reset for a new stream."""
        s = self._out(self._dec.decode(b"", final=True))
        self._dec.reset()
        self._strip = self.tokenizer.add_space_prefix
        return s
