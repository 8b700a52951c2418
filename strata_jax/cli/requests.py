"""Requests as the command line and the server take them: the rules of one request's values, the ``--prompts_file``
JSONL reader (errors named ``file:line``), chat prompts rendered with the model's template, token-id checks, and the
``--out_jsonl`` writer. One rule in one place: `check_request_values` serves the flags of ``strata-generate``, the
lines of ``--prompts_file`` and the fields of ``strata-serve``'s requests.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import numpy as np

from strata_jax.errors import StrataError, os_reason
from strata_jax.pipeline.scheduler import Request, RequestResult
from strata_jax.limits import SEED_MAX, TOP_K_MAX
from strata_jax.sampling import SamplingParams

REQUEST_KEYS = ("prompt", "prompt_ids", "chat", "max_new_tokens", "seed", "temperature", "top_k", "top_p", "min_p",
                "arrival", "id")
ARRIVAL_MAX = 86400.0   # seconds (a day): a larger ``arrival`` is a unit mistake, not a schedule


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list) -> dict:
    """`json.loads`' object hook: a dict of the pairs, or `_DuplicateKey` naming a key given twice."""
    d: dict = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(k)
        d[k] = v
    return d


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def as_float(v) -> float:
    """``float(v)`` of a number, or inf for an integer beyond a float's range (JSON's 1000...0 with 400 digits):
    ``float()`` raises OverflowError there, and the rules below refuse an infinite value."""
    try:
        return float(v)
    except OverflowError:
        return float("inf") if v > 0 else float("-inf")


def shown(v, limit: int = 40) -> str:
    """``repr(v)`` for an error line, cut to ``limit`` characters (an absurd number may have thousands of digits)."""
    r = repr(v)
    return r if len(r) <= limit else f"{r[:limit - 12]}... ({len(r)} chars)"


def lone_surrogate(s: str) -> int | None:
    """The index of the first lone surrogate in ``s`` (text that is not valid Unicode: invalid UTF-8 bytes in a
    command-line argument, or a JSON escape such as "\\ud800"), else None. The tokenizer cannot encode it."""
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def check_request_values(values: dict, label: Callable[[str], str]) -> None:
    """The rules one request's settings must follow, shared by the solo flags (``label = lambda k: "--" + k``) and
    the lines of ``--prompts_file`` (``label = lambda k: repr(k)``): types and ranges of ``temperature`` (finite),
    ``top_k`` (0..`TOP_K_MAX`), ``top_p`` ((0, 1]), ``min_p`` ([0, 1]), ``seed`` (0..2**32-1), ``max_new_tokens``
    (>= 1), ``arrival`` (0..`ARRIVAL_MAX` seconds), ``prompt`` (non-empty text), ``prompt_ids`` (non-empty list of
    ids >= 0; the vocabulary bound is `check_prompt_ids_vocab`), ``chat`` (bool), ``id`` (a string or a number).

    Raises:
      StrataError: the first value that breaks a rule, named with ``label(key)``.
    """
    import math

    for key, v in values.items():
        name = label(key)
        if key in ("temperature", "top_p", "min_p", "arrival"):
            if not _is_num(v):
                raise StrataError(f"{name} {shown(v)}: must be a number")
            if not math.isfinite(as_float(v)):
                raise StrataError(f"{name} {shown(v)}: must be a finite number" + (" (<= 0 is greedy)"
                                                                                   if key == "temperature" else ""))
            if key == "top_p" and not 0.0 < v <= 1.0:
                raise StrataError(f"{name} {v}: must lie in (0, 1]")
            if key == "min_p" and not 0.0 <= v <= 1.0:
                raise StrataError(f"{name} {v}: must lie in [0, 1]")
            if key == "arrival" and v < 0:
                raise StrataError(f"{name} {v}: must be >= 0 (seconds after the start)")
            if key == "arrival" and v > ARRIVAL_MAX:
                raise StrataError(f"{name} {v}: must be <= {ARRIVAL_MAX:.0f} (seconds after the start, not "
                                  f"milliseconds)")
        elif key in ("top_k", "seed", "max_new_tokens"):
            if not _is_int(v):
                raise StrataError(f"{name} {shown(v)}: must be an integer")
            if key == "top_k" and not 0 <= v <= TOP_K_MAX:
                raise StrataError(f"{name} {shown(v)}: must lie in 0..{TOP_K_MAX} (0 = 64; the sampler's candidates "
                                  f"are the top {TOP_K_MAX} of each row)")
            if key == "seed" and not 0 <= v <= SEED_MAX:
                raise StrataError(f"{name} {shown(v)}: must lie in 0..{SEED_MAX} (2**32 - 1)")
            if key == "max_new_tokens" and v < 1:
                raise StrataError(f"{name} {shown(v)}: must be >= 1")
        elif key == "prompt":
            if not isinstance(v, str):
                raise StrataError(f"{name} {shown(v)}: must be a string")
            if not v:
                raise StrataError(f"{name} is empty")
            bad = lone_surrogate(v)
            if bad is not None:
                raise StrataError(f"{name}: not valid Unicode text (a lone surrogate {v[bad]!r} at character {bad}: "
                                  f"invalid UTF-8 bytes, or an unpaired \\u escape)")
        elif key == "prompt_ids":
            if not isinstance(v, (list, tuple)) or not all(_is_int(t) for t in v):
                raise StrataError(f"{name} {v!r}: must be a list of integer token ids")
            if not v:
                raise StrataError(f"{name} is empty")
            bad = [int(t) for t in v if t < 0]
            if bad:
                raise StrataError(f"{name}: token ids must be >= 0 (got {shown(bad[:3], 80)})")
        elif key == "chat":
            if not isinstance(v, bool):
                raise StrataError(f"{name} {v!r}: must be true or false")
        elif key == "id":
            if not (isinstance(v, str) or (_is_num(v) and math.isfinite(as_float(v)))):
                raise StrataError(f"{name} {shown(v)}: must be a string or a number")
            if isinstance(v, str) and lone_surrogate(v) is not None:  # the id labels streamed text on stdout
                raise StrataError(f"{name} {shown(v)}: not valid Unicode text (an unpaired \\u escape)")
        else:
            raise StrataError(f"unknown key {name} (known: {', '.join(REQUEST_KEYS)})")


def check_prompt_ids_vocab(ids, vocab_size: int, name: str) -> None:
    """Raises StrataError when a token id lies outside the model's vocabulary 0..vocab_size-1."""
    bad = [int(t) for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise StrataError(f"{name}: token ids must lie in 0..{vocab_size - 1} (got {shown(bad[:3], 80)})")


def usable_tokenizer(source):
    """``(tokenizer, None)``, or ``(None, reason)`` when the model's tokenizer cannot be built (no tokenizer in the
    file, or one the tokenizer library refuses). ``source``: an `Engine` (its ``tokenizer``) or an open GGUF file
    (`strata_jax.tokenizer.Tokenizer.from_gguf` on its header, before any weights load)."""
    from strata_jax.gguf.reader import GGUFFile
    from strata_jax.tokenizer import Tokenizer

    try:
        return (Tokenizer.from_gguf(source) if isinstance(source, GGUFFile) else source.tokenizer), None
    except StrataError as e:
        return None, str(e)
    except Exception as e:  # the tokenizers library's own errors (e.g. "Error while initializing BPE")
        return None, f"cannot build it: {type(e).__name__}: {e}"


@dataclasses.dataclass
class PromptLine:
    """One validated line of ``--prompts_file`` (before tokenization): ``where`` is ``path:line``, ``rid`` the
    request's id, ``d`` the JSON object."""

    where: str
    rid: Any
    d: dict


def read_prompts_file(path: str) -> list[PromptLine]:
    """Read and check ``--prompts_file`` without a model: every line a JSON object with known keys, values of the
    right type and range (`check_request_values`, the solo flags' rules), one of ``prompt`` / ``prompt_ids``, unique
    scalar ids (a line without ``id`` gets its index among the requests).

    Raises:
      StrataError: unreadable or non-UTF-8 file, or a bad line, named as ``--prompts_file PATH:LINE``.
    """
    import json

    try:
        with open(path, encoding="utf-8-sig") as f:  # a leading byte-order mark is not part of line 1
            # JSON Lines ends lines with "\n" (or "\r\n") only: U+2028, U+0085, ... are legal inside a JSON string
            lines = [ln[:-1] if ln.endswith("\r") else ln for ln in f.read().split("\n")]
    except OSError as e:
        raise StrataError(f"--prompts_file {path}: {os_reason(e)}") from None
    except UnicodeDecodeError as e:
        raise StrataError(f"--prompts_file {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    out: list[PromptLine] = []
    seen: dict = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            d = json.loads(line, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as e:
            raise StrataError(f"--prompts_file {where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except _DuplicateKey as e:   # json keeps the last silently: one of the two values was a mistake
            raise StrataError(f"--prompts_file {where}: the key {e.args[0]!r} is given twice") from None
        except ValueError:  # not a syntax error: an integer of more than 4300 digits (Python's conversion limit)
            raise StrataError(f"--prompts_file {where}: a number with more than 4300 digits") from None
        if not isinstance(d, dict):
            got = {list: "an array", str: "a string", bool: "true/false", type(None): "null"}.get(type(d), "a number")
            raise StrataError(f"--prompts_file {where}: not a JSON object (got {got}; one request per line, e.g. "
                              f"{{\"prompt\": \"Hello\"}})")
        try:
            check_request_values(d, repr)
            if "prompt" in d and "prompt_ids" in d:
                raise StrataError("give one of 'prompt', 'prompt_ids', not both")
            if "prompt" not in d and "prompt_ids" not in d:
                raise StrataError("needs 'prompt' or 'prompt_ids'")
            if "prompt_ids" in d and d.get("chat"):
                raise StrataError("'chat' needs text: it cannot be combined with 'prompt_ids'")
        except StrataError as e:
            raise StrataError(f"--prompts_file {where}: {e}") from None
        rid = d.get("id", len(out))
        key = str(rid)  # ids stream as [id] labels: "1" and 1 would read alike
        if key in seen:
            raise StrataError(f"--prompts_file {where}: duplicate id {shown(rid, 80)} (already used on line "
                              f"{seen[key]}; ids are compared as text, and a line without 'id' gets its request "
                              f"index)")
        seen[key] = n
        out.append(PromptLine(where, rid, d))
    if not out:
        raise StrataError(f"--prompts_file {path}: no requests")
    return out


def build_requests(lines: list[PromptLine], tokenizer, *, default_max_new: int, default_sampling: SamplingParams,
                   default_chat: bool = False, system: str | None = None, stop_ids=(), vocab_size: int | None = None,
                   max_context: int | None = None, no_tokenizer_reason: str | None = None,
                   stop=None) -> list[Request]:
    """The `Request` of each checked line (`read_prompts_file`): text prompts tokenized (``chat``, default
    ``default_chat``, wraps them in the chat template with ``system``), ids checked against ``vocab_size``, every
    prompt checked against ``max_context``; missing keys take the defaults; ``stop`` (a `Request.stop` callback)
    applies to every request.

    Raises:
      StrataError: the first bad request, named as ``--prompts_file PATH:LINE`` and its id.
    """
    reqs = []
    for pl in lines:
        d = pl.d
        try:
            if "prompt_ids" in d:
                ids, text = [int(t) for t in d["prompt_ids"]], ""
                if vocab_size is not None:
                    check_prompt_ids_vocab(ids, vocab_size, "'prompt_ids'")
            else:
                if tokenizer is None:
                    raise StrataError(f"this model has no usable tokenizer ({no_tokenizer_reason or 'none'}): "
                                      f"give 'prompt_ids'")
                text = d["prompt"]
                if d.get("chat", default_chat):
                    text = tokenizer.apply_chat_template(chat_messages(text, system), add_generation_prompt=True)
                ids = list(tokenizer.encode(text))
                if not ids:
                    raise StrataError("'prompt' gives no tokens")
            if max_context is not None and len(ids) >= max_context:
                raise StrataError(f"prompt of {len(ids)} tokens does not fit in --max_context {max_context} (it "
                                  f"needs at least {len(ids) + 1}: the prompt and one generated token)")
        except StrataError as e:
            raise StrataError(f"--prompts_file {pl.where}: request {pl.rid!r}: {e}") from None
        ds = default_sampling
        samp = SamplingParams(float(d.get("temperature", ds.temperature)), int(d.get("top_k", ds.top_k)),
                              float(d.get("top_p", ds.top_p)), float(d.get("min_p", ds.min_p)),
                              int(d.get("seed", ds.seed)))
        reqs.append(Request(ids, int(d.get("max_new_tokens", default_max_new)), samp, tuple(stop_ids), stop,
                            float(d.get("arrival", 0.0)), rid=pl.rid, text=text))
    return reqs


def write_jsonl(path, results: list[RequestResult], tokenizer=None) -> None:
    """One JSON object per request: ``id`` (the prompts file's ``id``, else its line index), tokens, text (when a
    tokenizer is given), stop reason, slot, timings (`RequestResult.as_dict`). ``path``: a file path, or a text file
    open for writing."""
    import contextlib
    import json

    with (open(path, "w", encoding="utf-8") if isinstance(path, (str, bytes, os.PathLike))
          else contextlib.nullcontext(path)) as f:
        for r in results:
            d = r.as_dict()
            if tokenizer is not None:
                try:
                    d["text"] = tokenizer.decode(r.tokens, skip_special=True)
                except Exception:
                    d["text"] = None
            f.write(json.dumps(d) + "\n")




def chat_messages(text: str, system: str | None = None) -> list[dict]:
    """The conversation of one user message (after a system message when ``system`` is given), as ``--chat`` and
    ``--system`` make it; `strata_jax.tokenizer.Tokenizer.apply_chat_template` renders it."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
