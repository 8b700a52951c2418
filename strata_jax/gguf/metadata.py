"""Typed reads of GGUF metadata: the one place where a key's type and range are checked.

Every key the engine reads goes through `get_int`, `get_float`, `get_str`, `get_bool` or `get_array`. A value of
the wrong type or out of range raises `StrataError` with one line, ``<file>: key 'X' must be <what> (got <value>)``,
so a malformed or hostile file is refused where it is read, never with a traceback further on.

The source ``g`` is anything with ``.metadata`` (key -> value, as `strata_jax.gguf.GGUFFile` reads them: Python
int/float/bool/str for scalars, numpy arrays for numeric arrays, lists of str for string arrays) and ``.path``
(named in the messages), e.g. a `GGUFFile` or `strata_jax.testing.random_weights.VirtualGGUF`.

Types follow the GGUF value types: any integer type is an integer (a bool is not); a float accepts an integer
value (some converters write ``rope.freq_base`` as uint32) but never NaN or an infinity; a bool accepts only a
bool.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from strata_jax.errors import StrataError

REQUIRED = object()
"""Default of the getters: the key must be present (else ``<file>: GGUF metadata lacks 'X'``)."""


def short_repr(v: Any, limit: int = 80) -> str:
    """``repr(v)`` cut to ``limit`` characters; arrays named by element type and length (for messages)."""
    if isinstance(v, np.ndarray):
        return f"array of {v.size} {v.dtype}"
    if isinstance(v, (list, tuple)):
        return f"array of {len(v)} {type(v[0]).__name__ if v else 'values'}"
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def key_error(g, key: str, what: str, v: Any) -> StrataError:
    """The error ``<file>: key 'X' must be <what> (got <value>)``, for checks across keys made by the callers."""
    return StrataError(f"{getattr(g, 'path', 'GGUF file')}: key {key!r} must be {what} (got {short_repr(v)})")


def _fail(g, key: str, what: str, v: Any):
    raise key_error(g, key, what, v)


def _range_text(kind: str, lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"{kind} in [{lo}, {hi}]"
    if lo is not None:
        return f"{kind} >= {lo}"
    if hi is not None:
        return f"{kind} <= {hi}"
    return kind


def _lookup(g, key: str, default):
    md = g.metadata
    if key in md:
        return True, md[key]
    if default is REQUIRED:
        raise StrataError(f"{getattr(g, 'path', 'GGUF file')}: GGUF metadata lacks {key!r}")
    return False, default


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v) -> bool:
    return _is_int(v) or isinstance(v, (float, np.floating))


def get_int(g, key: str, default: Any = REQUIRED, *, min: int | None = None, max: int | None = None):
    """The integer value of ``key``, checked to lie in ``[min, max]`` (either bound optional).

    Returns:
      A Python int, or ``default`` (unchecked) when the key is absent.

    Raises:
      StrataError: the key is absent and required, not an integer, or out of range.
    """
    found, v = _lookup(g, key, default)
    if not found:
        return v
    if not _is_int(v) or (min is not None and v < min) or (max is not None and v > max):
        _fail(g, key, _range_text("an integer", min, max), v)
    return int(v)


def get_float(g, key: str, default: Any = REQUIRED, *, min: float | None = None, max: float | None = None,
              positive: bool = False):
    """The finite float value of ``key`` (an integer value is accepted), in ``[min, max]``, and ``> 0`` if
    ``positive``.

    Returns:
      A Python float, or ``default`` (unchecked) when the key is absent.

    Raises:
      StrataError: the key is absent and required, not a number, NaN or infinite, or out of range.
    """
    found, v = _lookup(g, key, default)
    if not found:
        return v
    if positive and min is None:
        what = f"a finite number in (0, {max}]" if max is not None else "a finite number > 0"
    else:
        what = _range_text("a finite number", min, max)
    if not _is_number(v):
        _fail(g, key, what, v)
    f = float(v)
    if not math.isfinite(f) or (positive and f <= 0) or (min is not None and f < min) or (max is not None and f > max):
        _fail(g, key, what, v)
    return f


def get_str(g, key: str, default: Any = REQUIRED, *, choices: tuple[str, ...] | None = None):
    """The string value of ``key`` (one of ``choices`` if given).

    Returns:
      A str, or ``default`` (unchecked) when the key is absent.

    Raises:
      StrataError: the key is absent and required, not a string, or not one of ``choices``.
    """
    found, v = _lookup(g, key, default)
    if not found:
        return v
    if not isinstance(v, str):
        _fail(g, key, "a string", v)
    if choices is not None and v not in choices:
        _fail(g, key, "one of " + ", ".join(repr(c) for c in choices), v)
    return v


def get_bool(g, key: str, default: Any = REQUIRED):
    """The bool value of ``key``.

    Returns:
      A Python bool, or ``default`` (unchecked) when the key is absent.

    Raises:
      StrataError: the key is absent and required, or not a bool.
    """
    found, v = _lookup(g, key, default)
    if not found:
        return v
    if not isinstance(v, (bool, np.bool_)):
        _fail(g, key, "a bool", v)
    return bool(v)


_ELEMENT = {"int": "integers", "float": "finite numbers", "str": "strings", "bool": "bools"}
_DTYPE_KINDS = {"int": "iu", "float": "iuf", "bool": "biu", "str": ""}


def _element_type_ok(t: type, of: str) -> bool:
    if of == "str":
        return t is str
    integer = issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_))
    if of == "int":
        return integer
    if of == "float":
        return integer or issubclass(t, (float, np.floating))
    return integer or issubclass(t, (bool, np.bool_))


def get_array(g, key: str, default: Any = REQUIRED, *, of: str, length: int | None = None, min_length: int = 0,
              min: float | None = None, max: float | None = None, as_numpy: bool = False):
    """The array value of ``key``: elements of kind ``of`` (``"int"``, ``"float"``, ``"str"``, ``"bool"``), exactly
    ``length`` (or at least ``min_length``) of them, numbers in ``[min, max]``.

    A numeric array read from a file is a numpy array; its dtype must match ``of`` (``"float"`` also takes integer
    dtypes). A bool array also accepts integer elements 0 and 1 (converters write layer masks either way).

    Returns:
      A tuple of Python values, or with ``as_numpy`` (numeric kinds) a 1-D numpy array (the stored one when it is
      already one: no copy), or ``default`` (unchecked) when the key is absent.

    Raises:
      StrataError: the key is absent and required, not an array of that kind, of another length, or an element is
        out of range.
    """
    found, v = _lookup(g, key, default)
    if not found:
        return v
    n = f"{length} " if length is not None else (f"at least {min_length} " if min_length else "")
    what = f"an array of {n}{_ELEMENT[of]}"
    if of in ("int", "float"):
        what = _range_text(what, min, max)
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.dtype.kind not in _DTYPE_KINDS[of]:
            _fail(g, key, what, v)
        arr = v
    elif isinstance(v, (list, tuple)):
        if not all(_element_type_ok(t, of) for t in set(map(type, v))):
            _fail(g, key, what, v)
        if of == "str":
            arr = None
        else:
            try:
                arr = np.asarray(v) if v else np.zeros(0, np.int64)
            except OverflowError:  # Python ints beyond 64 bits
                arr = None
            if arr is None or arr.dtype.kind == "O":  # e.g. -1 and 2**63 in one list
                _fail(g, key, what, v)
    else:
        _fail(g, key, what, v)
    if (length is not None and len(v) != length) or len(v) < min_length:
        _fail(g, key, what, v)
    if arr is None:
        return tuple(v)
    if arr.size:
        lo, hi = arr.min().item(), arr.max().item()
        bad = (of == "float" and not (math.isfinite(lo) and math.isfinite(hi))) or (of == "bool" and (lo < 0 or hi > 1))
        if bad or (min is not None and lo < min) or (max is not None and hi > max):
            _fail(g, key, what, v)
    if of == "bool":
        arr = arr.astype(bool)
    if as_numpy:
        return arr
    return tuple(arr.tolist())
