"""The OpenAI API as ``strata-serve`` speaks it: request bodies checked field by field, and the response bodies.

`parse_request` turns the JSON body of ``POST /v1/chat/completions`` or ``POST /v1/completions`` into a
`ParsedRequest` (prompt token ids, sampling, limits, stop strings, streaming) or raises `ApiError`, a 400 with
an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` naming the field:

* Honoured: ``messages`` (chat; roles system / developer / user / assistant, text content or text parts, rendered
  with the model's chat template as ``strata-generate --chat`` renders it), ``prompt`` (completions: text as is, or
  token ids), ``max_tokens`` / ``max_completion_tokens`` (refused when the context cannot hold that many after the
  prompt, as OpenAI's API refuses it; left out: up to the context's end), ``temperature`` (0..2, OpenAI's range),
  ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop`` (a string or a list), ``stream``,
  ``stream_options.include_usage``; ``return_token_ids`` (an extension, as vLLM's) adds the generated ids to each
  choice. Missing sampling fields take the server's flag values (``--temperature`` ...), so a request without them
  decodes as ``strata-generate`` does; each value follows the command line's rule
  (`strata_jax.cli.requests.check_request_values`). One exception: a sampled request without a ``seed`` on a server
  started without ``--seed`` draws a fresh random seed (`Defaults.fresh_seeds`), so unseeded requests vary as OpenAI
  clients expect; a ``seed`` makes a request reproducible.
* Known but not honoured, refused with 400 when set to anything but their neutral value: ``n`` > 1, ``logprobs``,
  ``top_logprobs``, ``tools`` / ``tool_choice`` / ``functions`` / ``function_call``, non-zero
  ``frequency_penalty`` / ``presence_penalty``, ``repetition_penalty`` != 1, ``logit_bias``, a non-text
  ``response_format``, ``best_of`` > 1, ``echo``, ``suffix``, several prompts.
* ``model``: left out, or the id ``/v1/models`` lists (the server answers another with 404 ``model_not_found``).
* Known and without effect here: ``user``, ``metadata``, ``store``, ``parallel_tool_calls``, ``service_tier``,
  ``reasoning_effort``, ``stream_options`` without ``stream``.
* Unknown fields are ignored (real clients send extras) and listed in ``ParsedRequest.ignored`` for one log line.

Stop strings: generation stops at the token that completes a stop string, as on the command line (the token ids are
the same); the returned text ends before the stop string, as the OpenAI API defines it (`TextStream`).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from typing import Any

from strata_jax.cli.requests import as_float, check_prompt_ids_vocab, check_request_values, lone_surrogate, shown
from strata_jax.errors import StrataError
from strata_jax.limits import SEED_MAX
from strata_jax.sampling import SamplingParams

MAX_TEMPERATURE = 2.0  # OpenAI's range of a request's temperature is [0, 2]

CHAT, COMPLETION = "chat", "completion"

_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "stream", "stream_options", "n", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty",
           "repetition_penalty", "logit_bias", "user", "metadata", "store", "service_tier", "return_token_ids"}
KNOWN = {CHAT: _COMMON | {"messages", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                          "response_format", "reasoning_effort"},
         COMPLETION: _COMMON | {"prompt", "best_of", "echo", "suffix"}}
ROLES = {"system", "developer", "user", "assistant"}


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body.

    Args:
      status: HTTP status (400, 401, 404, 405, 429, 500, 503).
      message: what is wrong, naming the field.
      param: the request field at fault (None when none is).
      type_: ``invalid_request_error`` (4xx) or ``server_error`` (5xx).
      code: an OpenAI error code (``invalid_api_key``, ``rate_limit_exceeded``, ...), or None.
      headers: extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param)


@dataclasses.dataclass
class Defaults:
    """The server's defaults for fields a request leaves out (the engine flags' values). ``fresh_seeds``: a sampled
    request (temperature > 0) without a ``seed`` draws a fresh random one instead of ``sampling.seed`` (the server
    was started without ``--seed``: OpenAI clients expect unseeded requests to vary)."""

    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    fresh_seeds: bool = False


@dataclasses.dataclass
class ParsedRequest:
    """A checked request: ``prompt_ids`` (list[int]) and ``prompt_text`` (the rendered text, '' for token-id
    prompts), ``max_tokens``, ``sampling``, ``stop`` (list[str]), ``stream``, ``include_usage``,
    ``return_token_ids``, ``model`` (as sent, or None) and ``ignored`` (unknown field names)."""

    kind: str
    prompt_ids: list
    prompt_text: str
    max_tokens: int
    sampling: SamplingParams
    stop: list
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    model: str | None = None
    ignored: list = dataclasses.field(default_factory=list)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _type_name(v) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def _check(values: dict, names: dict) -> None:
    """`check_request_values` on the given ``{rule key: value}``, its error as a 400 naming the API field."""
    for key, v in values.items():
        try:
            check_request_values({key: v}, lambda k: repr(names.get(k, k)))
        except StrataError as e:
            raise bad(names.get(key, key), str(e)) from None


def _unsupported(body: dict, kind: str) -> None:
    """400 for the fields this server knows but cannot honour (see the module doc)."""
    def given(name):
        return body.get(name) is not None

    n = body.get("n")
    if given("n"):
        if not _is_int(n):
            raise bad("n", f"'n' {shown(n)}: must be an integer")
        if n != 1:
            raise bad("n", f"'n' {shown(n)}: only one choice per request is supported (n = 1)")
    if kind == CHAT:
        lp = body.get("logprobs")
        if given("logprobs") and not isinstance(lp, bool):
            raise bad("logprobs", f"'logprobs' {lp!r}: must be a boolean")
        if lp:
            raise bad("logprobs", "'logprobs': log probabilities are not supported")
    elif given("logprobs"):
        raise bad("logprobs", "'logprobs': log probabilities are not supported")
    if given("top_logprobs"):
        raise bad("top_logprobs", "'top_logprobs': log probabilities are not supported")
    for name in ("tools", "functions"):
        if given(name) and body[name] != []:
            raise bad(name, f"'{name}': tool and function calls are not supported")
    for name in ("tool_choice", "function_call"):
        if given(name) and body[name] != "none":
            raise bad(name, f"'{name}': tool and function calls are not supported")
    for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
        v = body.get(name)
        if given(name):
            if not _is_num(v) or not math.isfinite(as_float(v)):
                raise bad(name, f"'{name}' {shown(v)}: must be a finite number")
            if v != neutral:
                raise bad(name, f"'{name}' {v}: penalties are not applied (batch windows decode without them; "
                                f"leave it at {neutral:g})")
    if given("logit_bias"):
        if not isinstance(body["logit_bias"], dict):
            raise bad("logit_bias", f"'logit_bias': must be an object, got {_type_name(body['logit_bias'])}")
        if body["logit_bias"]:
            raise bad("logit_bias", "'logit_bias': token biases are not supported")
    rf = body.get("response_format")
    if given("response_format"):
        if not isinstance(rf, dict) or rf.get("type") != "text":
            raise bad("response_format", "'response_format': only {\"type\": \"text\"} is supported")
    if given("best_of"):
        if not _is_int(body["best_of"]):
            raise bad("best_of", f"'best_of' {shown(body['best_of'])}: must be an integer")
        if body["best_of"] != 1:
            raise bad("best_of", f"'best_of' {shown(body['best_of'])}: only one candidate per request is supported")
    if given("echo"):
        if not isinstance(body["echo"], bool):
            raise bad("echo", f"'echo' {body['echo']!r}: must be a boolean")
        if body["echo"]:
            raise bad("echo", "'echo': echoing the prompt is not supported")
    if given("suffix") and body["suffix"] != "":
        raise bad("suffix", "'suffix': insertion (a suffix after the completion) is not supported")


def _check_unicode(body) -> None:
    """400 for a string anywhere in the body (keys included) that is not valid Unicode: JSON may carry an unpaired
    surrogate escape ("\\ud800"), which the tokenizer cannot encode. ``param`` names the field as the other errors
    do (``messages[0].content``; a bad key: the object holding it). Walked without recursion (a deeply nested body
    must not reach Python's recursion limit)."""
    todo = [(body, "", False)]
    while todo:
        v, where, is_key = todo.pop()
        if isinstance(v, str):
            i = lone_surrogate(v)
            if i is not None:
                what = f"'{where}'" if where else "the request body"
                raise bad(where or None, f"{'a key in ' if is_key else ''}{what}: not valid Unicode text (an "
                                         f"unpaired surrogate {v[i]!r} at character {i})")
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):  # popped in the body's order
                todo.append((x, f"{where}.{k}" if where else k, False))
                todo.append((k, where, True))
        elif isinstance(v, list):
            todo.extend((x, f"{where}[{j}]", False) for j, x in reversed(list(enumerate(v))))


def _content_text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") == "text" and not isinstance(p.get("text"), str):
                w = f"{where}.content[{j}].text"
                raise bad(w, f"'{w}': missing" if p.get("text") is None else
                          f"'{w}': must be a string, got {_type_name(p['text'])}")
            if not isinstance(p, dict) or p.get("type") != "text":
                kind = p.get("type") if isinstance(p, dict) else _type_name(p)
                raise bad(f"{where}.content[{j}]", f"'{where}.content[{j}]': only text parts are supported "
                                                   f"(got {kind!r})")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"{where}.content", f"'{where}.content': must be a string or a list of text parts, got "
                                  f"{_type_name(content)}")


def chat_messages(messages) -> list[dict]:
    """The ``messages`` field as the chat template takes it (``developer`` becomes ``system``).

    Raises:
      ApiError: not a non-empty array of ``{"role", "content"}`` objects with supported roles and text content.
    """
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages': must be a non-empty array of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"'{where}': must be an object with 'role' and 'content'")
        role = m.get("role")
        if role == "tool" or m.get("tool_calls") or m.get("function_call"):
            raise bad(where, f"'{where}': tool and function calls are not supported")
        if role is None:
            raise bad(f"{where}.role", f"'{where}.role': missing (one of {', '.join(sorted(ROLES))})")
        if role not in ROLES:
            raise bad(f"{where}.role", f"'{where}.role' {role!r}: must be one of {', '.join(sorted(ROLES))}")
        if "content" not in m or m["content"] is None:
            raise bad(f"{where}.content", f"'{where}.content': missing")
        out.append({"role": "system" if role == "developer" else role, "content": _content_text(m["content"], where)})
    return out


def _prompt(body: dict, tokenizer, vocab_size: int) -> tuple[list[int], str]:
    """The completions ``prompt``: text (encoded as is), or token ids; one prompt per request."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad("prompt", "'prompt' is empty")
        ids = list(tokenizer.encode(p))
        if not ids:
            raise bad("prompt", "'prompt' gives no tokens")
        return ids, p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        try:
            check_prompt_ids_vocab(p, vocab_size, "'prompt'")
        except StrataError as e:
            raise bad("prompt", str(e)) from None
        return [int(t) for t in p], ""
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("prompt", "'prompt': one prompt per request is supported (send one request per prompt)")
    if p is None:
        raise bad("prompt", "'prompt': missing")
    raise bad("prompt", "'prompt': must be a string, an array of token ids, or an array with one of those")


def parse_request(body, kind: str, *, tokenizer, max_context: int, vocab_size: int,
                  defaults: Defaults) -> ParsedRequest:
    """Check one request body (see the module doc) and tokenize its prompt.

    Args:
      body: the decoded JSON body.
      kind: `CHAT` or `COMPLETION`.
      tokenizer: the model's `strata_jax.tokenizer.Tokenizer`.
      max_context: the engine's cells per sequence: the prompt must leave room for one generated token, and a
        ``max_tokens`` given for the prompt and its completion.
      vocab_size: token ids of a ``prompt`` must lie below it.
      defaults: the server's defaults.

    Raises:
      ApiError: 400 naming the first bad field.
    """
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {_type_name(body)}")
    _check_unicode(body)
    ignored = sorted(k for k in body if k not in KNOWN[kind])
    _unsupported(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"'model' {model!r}: must be a string")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", f"'stream' {stream!r}: must be a boolean")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("stream_options", f"'stream_options': must be an object, got {_type_name(so)}")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise bad("stream_options.include_usage", f"'stream_options.include_usage' {iu!r}: must be a boolean")
        include_usage = bool(iu) and bool(stream)
    rti = body.get("return_token_ids")
    if rti is not None and not isinstance(rti, bool):
        raise bad("return_token_ids", f"'return_token_ids' {rti!r}: must be a boolean")
    mt = body.get("max_completion_tokens")
    mt_name = "max_completion_tokens"
    if mt is None:
        mt, mt_name = body.get("max_tokens"), "max_tokens"
    names = {"max_new_tokens": mt_name}
    values = {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed") if body.get(k) is not None}
    if mt is not None:
        values["max_new_tokens"] = mt
    t = values.get("temperature")
    if _is_num(t) and not (math.isfinite(as_float(t)) and 0.0 <= t <= MAX_TEMPERATURE):  # the CLI takes any >= 0
        raise bad("temperature", f"'temperature' {shown(t)}: must lie in [0, 2] (0 is greedy)")
    _check(values, names)
    d = defaults.sampling
    temperature = float(values.get("temperature", d.temperature))
    seed = values.get("seed", d.seed)
    if "seed" not in values and defaults.fresh_seeds and temperature > 0:
        seed = secrets.randbelow(SEED_MAX + 1)
    sampling = SamplingParams(temperature, int(values.get("top_k", d.top_k)), float(values.get("top_p", d.top_p)),
                              float(values.get("min_p", d.min_p)), int(seed))
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop", "'stop': must be a string or an array of strings")
    if any(s == "" for s in stop):
        raise bad("stop", "'stop': a stop string must not be empty")
    if kind == CHAT:
        msgs = chat_messages(body.get("messages"))
        try:
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        except StrataError as e:
            raise bad("messages", f"'messages': {e}") from None
        ids = list(tokenizer.encode(text))
        field = "messages"
    else:
        ids, text = _prompt(body, tokenizer, vocab_size)
        field = "prompt"
    if len(ids) >= max_context:
        raise bad(field, f"'{field}': the prompt is {len(ids)} tokens, and this server's context holds "
                         f"{max_context} (--max_context): at most {max_context - 1} prompt tokens leave room for one "
                         f"generated token")
    if mt is not None and len(ids) + mt > max_context:  # as OpenAI's API: a limit that cannot be reached is refused
        raise bad(mt_name, f"'{mt_name}' {mt}: the prompt is {len(ids)} tokens and this server's context holds "
                           f"{max_context} (--max_context), so at most {max_context - len(ids)} tokens can be "
                           f"generated (leave '{mt_name}' out to generate up to the context's end)")
    return ParsedRequest(kind, ids, text, int(mt) if mt is not None else defaults.max_tokens, sampling, stop,
                         bool(stream), include_usage, bool(rti), model, ignored)


# ---- responses ----------------------------------------------------------------------------------------------------
FINISH = {"eos": "stop", "stop string": "stop", "max tokens": "length", "context end": "length"}


def finish_reason(stop_reason: str) -> str | None:
    """The OpenAI ``finish_reason`` of a scheduler stop reason (None for cancelled / refused / error)."""
    return FINISH.get(stop_reason)


def error_of(stop_reason: str, kind: str) -> ApiError | None:
    """The error of a request that ended without a finish reason: ``refused: ...`` (its prompt could not be read:
    400, naming ``messages`` or ``prompt`` as ``kind`` says), ``error: ...`` (500), ``cancelled`` (503: the server
    is shutting down)."""
    if stop_reason in FINISH:
        return None
    if stop_reason.startswith("refused: "):
        return ApiError(400, stop_reason[len("refused: "):], "messages" if kind == CHAT else "prompt")
    if stop_reason == "cancelled":
        return ApiError(503, "the request was cancelled (the server is shutting down)")
    return ApiError(500, f"the engine failed on this request ({stop_reason})")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": int(prompt_tokens), "completion_tokens": int(completion_tokens),
            "total_tokens": int(prompt_tokens) + int(completion_tokens)}


class Response:
    """Builds the bodies of one request's answer (non-streaming object, streaming chunks)."""

    def __init__(self, kind: str, rid: str, model: str, created: int | None = None, return_token_ids: bool = False):
        self.kind, self.rid, self.model = kind, rid, model
        self.created = int(created if created is not None else time.time())
        self.return_token_ids = return_token_ids
        self.object = "chat.completion" if kind == CHAT else "text_completion"

    def _choice(self, text: str | None, finish: str | None, token_ids: list | None, chunk: bool,
                role: bool = False) -> dict:
        if self.kind == CHAT:
            if chunk:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish}
        else:
            c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if self.return_token_ids and token_ids is not None:
            c["token_ids"] = [int(t) for t in token_ids]
        return c

    def full(self, text: str, finish: str, prompt_tokens: int, tokens: list) -> dict:
        """The non-streaming answer."""
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self._choice(text, finish, tokens, chunk=False)],
                "usage": usage(prompt_tokens, len(tokens))}

    def chunk(self, text: str | None, finish: str | None = None, token_ids: list | None = None, role: bool = False,
              include_usage: bool = False) -> dict:
        """One streaming chunk (``usage`` null when the client asked for usage: it comes in the last chunk)."""
        d = {"id": self.rid, "object": self.object + (".chunk" if self.kind == CHAT else ""),
             "created": self.created, "model": self.model,
             "choices": [self._choice(text, finish, token_ids, chunk=True, role=role)]}
        if include_usage:
            d["usage"] = None
        return d

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage counts."""
        return {"id": self.rid, "object": self.object + (".chunk" if self.kind == CHAT else ""),
                "created": self.created, "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}


class TextStream:
    """Token ids to response text, with the OpenAI stop rule: the text ends before the first stop string (the
    engine stops at the token that completes it). While streaming, the last ``len(longest stop) - 1`` characters
    are held back until they cannot start a stop string. Concatenating every `feed` and `finish` gives the whole
    answer's text."""

    def __init__(self, tokenizer, stop: list[str]):
        self.dec = tokenizer.stream_decoder(skip_special=True)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.cut: int | None = None

    def _release(self, final: bool) -> str:
        if self.cut is None and self.stop:
            hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.cut = min(hits)
        if self.cut is not None:
            end = self.cut
        else:
            end = len(self.text) if final else len(self.text) - self.hold
        out = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def feed(self, tokens) -> str:
        """The text these tokens add that can be sent now."""
        for t in tokens:
            self.text += self.dec.feed(int(t))
        return self._release(False)

    def finish(self) -> str:
        """The rest of the text (held-back characters and bytes)."""
        self.text += self.dec.flush()
        return self._release(True)
