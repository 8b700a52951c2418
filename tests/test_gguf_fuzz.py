"""Fuzz test: malformed GGUF headers built from valid tiny fixtures (the hybrids qwen3next and qwen4exp, the dense
qwen3) go through `open_gguf` and `config_from_gguf`, and the files accepted there through the engine's load: the
tensor check of every stage and the build of the stages and their state (`Engine`, weights kept in their block
formats, a context of 8 cells) and of the MTP layer when the file declares one. Every case must end in the project's
own error (`StrataError`, one line starting with the file's path) or in a file and config that keep their invariants
and build; any other exception, more than `CASE_SECONDS` for reading one case (`BUILD_SECONDS` for its build), or a
traced Python allocation peak above `CASE_PEAK_BYTES` while reading it fails.

Mutations (tests/gguf_edit.py locates every header field with gguf-py's GGUFReader): truncation at or near a field
boundary (or anywhere), a number field (count, length, value type, dim, block format, offset, a numeric value) set to
an edge value, header bytes overwritten, a key's value replaced by (or a missing key the readers use added with) a
value of any GGUF type (int edges, NaN/inf, strings, arrays, nested arrays), duplicated / dropped keys and tensor
infos, key and tensor counts off by one, alignment keys; up to two of them stacked.

CI runs a fixed set (``derandomize``) of `EXAMPLES` cases, well under a minute. By hand: a longer and fresh run,
``STRATA_FUZZ_EXAMPLES=5000 STRATA_FUZZ_SEED=$RANDOM pytest -q tests/test_gguf_fuzz.py``; ``STRATA_FUZZ_LOG=path``
appends one line per case (``ok`` or the error message without the file path, a tab, the mutation) to summarise
what was refused.
"""

from __future__ import annotations

import math
import os
import time
import tracemalloc

import gguf_edit as E
import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_jax.errors import StrataError
from strata_jax.gguf import open_gguf
from strata_jax.gguf.blocks import GGML_QUANT_SIZES
from strata_jax.models.registry import config_from_gguf, get_family
from strata_jax.pipeline.engine import Engine

EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "300"))
SEED = os.environ.get("STRATA_FUZZ_SEED")
LOG = os.environ.get("STRATA_FUZZ_LOG")
CASE_SECONDS = 3.0  # a fixture header parses in a few ms; this bound catches hangs and blow-ups, not speed
CASE_PEAK_BYTES = 32 << 20  # the fixtures are 0.3-3 MB (memory-mapped, not traced)
BUILD_SECONDS = 30.0  # a fixture builds in ~0.1-0.5 s; the first build of a process also starts JAX

FIXTURES = [E.FIXTURE.parent / f"{a}_q8_0.gguf" for a in ("qwen3next", "qwen4exp", "qwen3")]
for _p in FIXTURES:
    get_family(_p.name.split("_")[0])  # import the family modules here, not inside the first timed case
# keys the readers use that the fixtures do not all have
EXTRA_KEYS = ["general.alignment", "{a}.vocab_size", "{a}.nextn_predict_layers", "{a}.full_attention_interval",
              "{a}.feed_forward_length", "{a}.attention.sliding_window", "{a}.attention.scale",
              "tokenizer.ggml.bos_token_id", "{a}.ple.conv_kernel", "{a}.ple.eos_token_id", "{a}.ssm.conv_kernel"]

_INT_RANGES = {E.U8: (0, 2**8 - 1), E.I8: (-2**7, 2**7 - 1), E.U16: (0, 2**16 - 1), E.I16: (-2**15, 2**15 - 1),
               E.U32: (0, 2**32 - 1), E.I32: (-2**31, 2**31 - 1), E.U64: (0, 2**64 - 1), E.I64: (-2**63, 2**63 - 1)}
_EDGES = [0, 1, 2, 3, 4, 7, 8, 12, 13, 16, 31, 32, 33, 63, 64, 255, 256, 4096, 2**16, 2**31 - 1, 2**31, 2**32 - 1,
          2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1]


def _element(etype: int):
    """Values of GGUF scalar type ``etype``."""
    if etype in _INT_RANGES:
        lo, hi = _INT_RANGES[etype]
        return st.one_of(st.integers(lo, hi), st.sampled_from([v for v in _EDGES + [-1, lo] if lo <= v <= hi]))
    if etype == E.F32:
        return st.floats(width=32)
    if etype == E.F64:
        return st.floats()
    if etype == E.BOOL:
        return st.booleans()
    return st.one_of(st.text(max_size=12), st.binary(max_size=12))  # invalid UTF-8 too


_SCALAR_TYPES = sorted(_INT_RANGES) + [E.F32, E.F64, E.BOOL, E.STR]


@st.composite
def gguf_value(draw, depth: int = 0):
    """(vtype, value) of any GGUF type; arrays are ``(etype, list)``, nested up to 6 levels."""
    kind = draw(st.sampled_from(_SCALAR_TYPES + [E.ARR] * 3))
    if kind != E.ARR:
        return kind, draw(_element(kind))
    etype = draw(st.sampled_from(_SCALAR_TYPES + ([E.ARR] if depth < 6 else [])))
    if etype == E.ARR:
        return E.ARR, (E.ARR, draw(st.lists(gguf_value(depth + 1).filter(lambda v: v[0] == E.ARR).map(
            lambda v: v[1]), max_size=3)))
    return E.ARR, (etype, draw(st.lists(_element(etype), max_size=draw(st.sampled_from([0, 1, 4, 16, 600])))))


def _mutate_value(draw, lay: E.Layout, data: bytes, arch: str) -> bytes:
    keys = list(lay.kv) + [k.format(a=arch) for k in EXTRA_KEYS]
    key = draw(st.sampled_from(keys))
    vtype, v = draw(gguf_value())
    new = E.kv(key, vtype, v)
    desc = f"{key} = type {vtype} {_short(v)}"
    return desc, (E.replace_kv(lay, key, new) if key in lay.kv else E.add_kv(lay, new))


def _mutate_structure(draw, lay: E.Layout, data: bytes, arch: str) -> bytes:
    h = E.header(lay)
    what = draw(st.sampled_from(["dup_kv", "dup_tensor", "drop_kv", "n_tensors", "n_kv", "swap_offsets",
                                 "alignment", "drop_tensor"]))
    if what == "dup_kv":
        key = draw(st.sampled_from(list(lay.kv)))
        a, b = lay.kv[key]
        return f"duplicate key {key}", E.add_kv(lay, lay.data[a:b])
    if what in ("dup_tensor", "drop_tensor"):
        name = draw(st.sampled_from(list(lay.tensors)))
        a, b = lay.tensors[name]
        if what == "dup_tensor":
            return f"duplicate tensor {name}", E.rebuild(lay, h + h[a:b], n_tensors=lay.n_tensors + 1)
        return f"drop tensor {name}", E.rebuild(lay, h[:a] + h[b:], n_tensors=lay.n_tensors - 1)
    if what == "drop_kv":
        key = draw(st.sampled_from(list(lay.kv)))
        return f"drop key {key}", E.drop_kv(lay, key)
    if what in ("n_tensors", "n_kv"):
        n = getattr(lay, what)
        v = draw(st.sampled_from([n + 1, n - 1, n + 2, 0, 2 * n]))
        return f"{what} = {v}", E.rebuild(lay, h, **{what: v})
    if what == "swap_offsets":
        x, y = draw(st.lists(st.sampled_from(list(lay.tensors)), min_size=2, max_size=2, unique=True))
        px, py = E.part(lay, f"tensor:{x}:offset"), E.part(lay, f"tensor:{y}:offset")
        out = E.set_field(data, px, E.get_field(data, py))
        return f"swap offsets of {x} and {y}", E.set_field(out, py, E.get_field(data, px))
    align = draw(st.sampled_from([1, 2, 16, 32, 64, 4096]))
    vtype = draw(st.sampled_from([t for t in (E.U32, E.U8, E.I32, E.U64) if align <= _INT_RANGES[t][1]]))
    pad = draw(st.sampled_from([align, 32]))
    return (f"general.alignment = type {vtype} {align}, data padded to {pad}",
            E.add_kv(lay, E.kv("general.alignment", vtype, align), align=pad))


def _mutate_number(draw, lay: E.Layout, data: bytes, arch: str) -> bytes:
    part = draw(st.sampled_from(_numeric_parts(lay)))
    if part.end > len(data):
        return "no-op", data
    if part.fmt in ("<f", "<d"):
        v = draw(st.floats(width=32 if part.fmt == "<f" else 64))
    else:
        orig = int(E.get_field(data, part))
        v = draw(st.one_of(st.sampled_from(_EDGES), st.integers(0, 2**64 - 1),
                           st.sampled_from([orig + d for d in (-1, 1, 2, 32)] + [orig * 2, -orig])))
    return f"{part.label} @{part.start} = {v!r}", E.set_field(data, part, v)


def _mutate_bytes(draw, lay: E.Layout, data: bytes, arch: str) -> bytes:
    out = bytearray(data)
    edits = []
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, min(lay.header_end, len(out)) - 1))
        out[pos] = draw(st.sampled_from([0x00, 0xFF, 0x80, 0x7F]) | st.integers(0, 255))
        edits.append(f"@{pos}={out[pos]:#04x}")
    return "bytes " + " ".join(edits), bytes(out)


def _truncate(draw, lay: E.Layout, data: bytes, arch: str) -> bytes:
    bounds = sorted({p.start for p in lay.parts} | {p.end for p in lay.parts} | {lay.data_offset})
    cut = draw(st.one_of(st.sampled_from(bounds).flatmap(lambda b: st.integers(b - 2, b + 2)),
                         st.integers(0, len(data) - 1)))
    cut = max(0, min(cut, len(data) - 1))
    return f"cut at {cut}", data[:cut]


_NUMERIC = {}


def _numeric_parts(lay: E.Layout):
    key = id(lay)
    if key not in _NUMERIC:
        _NUMERIC[key] = [p for p in lay.parts if p.fmt is not None]
    return _NUMERIC[key]


_EDITS = [_mutate_value, _mutate_structure]  # rebuild the file from the layout
_BYTE_EDITS = [_mutate_number, _mutate_bytes, _truncate]  # edit bytes in place (after an edit above: shifted fields)


class Case:
    """A malformed file: its bytes and a short description (what hypothesis prints for a failing case)."""

    def __init__(self, desc: str, data: bytes):
        self.desc, self.data = desc, data

    def __repr__(self) -> str:
        return f"Case({self.desc!r}, {len(self.data)} bytes)"


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


@st.composite
def malformed(draw) -> Case:
    path = draw(st.sampled_from(FIXTURES))
    lay = E.layout(path)
    arch = path.name.split("_")[0]
    first = draw(st.sampled_from(_EDITS + _BYTE_EDITS))
    desc, data = first(draw, lay, lay.data, arch)
    descs = [path.name, desc]
    if first in _EDITS and draw(st.booleans()):
        desc, data = draw(st.sampled_from(_BYTE_EDITS))(draw, lay, data, arch)
        descs.append(desc)
    return Case("; ".join(descs), data)


def _check_invariants(g, size: int) -> None:
    """What an accepted file must satisfy: tensors inside the data region, aligned, sized by their shape, apart."""
    end = g.data_offset
    for t in sorted(g.tensors.values(), key=lambda t: t.offset):
        block, bsize = GGML_QUANT_SIZES[t.qtype]
        assert all(d >= 1 for d in t.shape) and t.nbytes == math.prod(t.shape) // block * bsize, t
        assert (t.offset - g.data_offset) % g.alignment == 0 and t.offset >= end and t.offset + t.nbytes <= size, t
        end = t.offset + t.nbytes


def _check_config(cfg) -> None:
    for f, v in vars(cfg).items():
        if isinstance(v, bool):
            continue
        if isinstance(v, int):
            assert v >= -1, (f, v)
        elif isinstance(v, float):
            assert math.isfinite(v) and v > 0 or f == "attn_scale" and v > 0, (f, v)
    assert cfg.n_layer >= 1 and len(cfg.layer_local) == cfg.n_layer
    assert len(getattr(cfg, "layer_recurrent", (False,) * cfg.n_layer)) == cfg.n_layer
    assert cfg.n_head % cfg.n_head_kv == 0 and cfg.head_dim >= 1 and cfg.rope_dim <= cfg.head_dim


def _refusal(path, e: StrataError) -> str:
    """The message of a refusal without the file's path, checked to be one line about that file."""
    msg = str(e)
    assert "\n" not in msg and msg.startswith(f"{path}: ") and len(msg) < len(str(path)) + 400, msg[:2000]
    return msg[len(str(path)) + 2:]


def _build(path, g) -> str:
    """What the engine builds from an accepted file (module docstring): ``"built"`` or ``"build: <refusal>"``."""
    t0 = time.perf_counter()
    try:
        engine = Engine(g, max_context=8, weights="blocks")
        if getattr(engine.cfg, "n_nextn", 0):
            engine.mtp.enable(1)
        outcome = "built"
    except StrataError as e:
        outcome = "build: " + _refusal(path, e)
    dt = time.perf_counter() - t0
    assert dt < BUILD_SECONDS, f"{dt:.2f} s to build one case ({outcome})"
    return outcome


def run_case(path, data: bytes, desc: str = "") -> str:
    """Write ``data`` to ``path``, read it and, if accepted, build it; returns ``"built"`` or the refusal (file path
    removed; a refusal at the build is prefixed ``build:``)."""
    path.write_bytes(data)
    tracemalloc.start()
    t0 = time.perf_counter()
    g = None
    try:
        try:
            g = open_gguf(path)
            _check_invariants(g, len(data))
            _check_config(config_from_gguf(g))
            outcome = "ok"
        except StrataError as e:
            outcome = _refusal(path, e)
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert dt < CASE_SECONDS, f"{dt:.2f} s for one case ({outcome})"
    assert peak < CASE_PEAK_BYTES, f"{peak / 2**20:.0f} MiB traced for one case ({outcome})"
    if outcome == "ok":
        outcome = _build(path, g)
    if LOG:
        with open(LOG, "a") as f:
            f.write(f"{outcome}\t{desc}\n")
    return outcome


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


_N = [0]


_settings = settings(max_examples=EXAMPLES, derandomize=SEED is None, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much, HealthCheck.large_base_example])


@_settings
@given(case=malformed())
def test_malformed_headers_are_refused_cleanly(case_dir, case):
    _N[0] += 1  # a fresh file per case (the last one's map may still be open: never truncate a mapped file)
    path = case_dir / f"case{_N[0]}.gguf"
    try:
        run_case(path, case.data, case.desc)
    finally:
        path.unlink(missing_ok=True)


if SEED is not None:
    test_malformed_headers_are_refused_cleanly = hypothesis.seed(int(SEED))(test_malformed_headers_are_refused_cleanly)


def test_fixtures_pass_the_checks(case_dir):
    """The unmutated fixtures read, build their configs and build (the fuzz cases start from valid files)."""
    for p in FIXTURES:
        assert run_case(case_dir / p.name, p.read_bytes()) == "built"
