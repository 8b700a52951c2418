"""Malformed GGUF files built from a valid one, for tests/test_reader.py and tests/test_gguf_fuzz.py.

Where each header field lies comes from gguf-py's ``GGUFReader`` (independent of the reader under test): every
field part (a key's length, its bytes, the value type, an array's element type and count, a tensor's name, dims,
block format, offset) with its byte range. `rebuild` puts an edited header back in front of the unchanged tensor
data, padded to the alignment, so one edit breaks one thing.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "hybrid" / "qwen3next_q8_0.gguf"

# GGUF value types (gguf spec)
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
        I64: "<q", F64: "<d"}


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of a header field: ``label`` (e.g. ``kv:general.name:key_len``), bytes ``[start, end)``, and the
    struct format of a number (``None`` for string bytes)."""

    label: str
    start: int
    end: int
    fmt: str | None


@dataclasses.dataclass(frozen=True)
class Layout:
    """A valid file's bytes and where its header fields are.

    Attributes:
      data: the whole file.
      parts: every field part in file order (magic/version/counts first).
      kv: key -> (start, end) of the whole key/value.
      tensors: tensor name -> (start, end) of its tensor info; ``tensor_parts[name]`` -> its parts by role
        (``name_len``, ``name``, ``n_dims``, ``dims``, ``type``, ``offset``).
      kv_end: where the tensor infos start; header_end: where they end; data_offset: where tensor data starts.
    """

    data: bytes
    parts: tuple[Part, ...]
    kv: dict
    tensors: dict
    tensor_parts: dict
    kv_end: int
    header_end: int
    data_offset: int

    @property
    def n_tensors(self) -> int:
        return struct.unpack_from("<Q", self.data, 8)[0]

    @property
    def n_kv(self) -> int:
        return struct.unpack_from("<Q", self.data, 16)[0]


_TENSOR_ROLES = ("name_len", "name", "n_dims", "dims", "type", "offset")
_NUM = {"u1": "B", "i1": "b", "u2": "H", "i2": "h", "u4": "I", "i4": "i", "f4": "f", "u8": "Q", "i8": "q", "f8": "d",
        "b1": "?"}


def _fmt(dtype) -> str:
    import numpy as np

    dt = np.dtype(dtype)
    return "<" + _NUM[dt.kind + str(dt.itemsize)]


@functools.lru_cache(maxsize=4)
def layout(path: str | Path = FIXTURE) -> Layout:
    import gguf

    r = gguf.GGUFReader(str(path))
    data = Path(path).read_bytes()
    parts = [Part("magic", 0, 4, None), Part("version", 4, 8, "<I"), Part("n_tensors", 8, 16, "<Q"),
             Part("n_kv", 16, 24, "<Q")]
    kvs = {}
    kv_end = 24
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        pos = int(f.offset)
        roles = ["key_len", "key", "vtype"] + (["etype", "count"] if f.types[0] == gguf.GGUFValueType.ARRAY else [])
        strings = f.types[-1] == gguf.GGUFValueType.STRING
        for j, p in enumerate(f.parts):
            if j < len(roles):
                role = roles[j]
            else:  # the value: a string's length and bytes, or array elements
                role = ("str_len" if (j - len(roles)) % 2 == 0 else "str") if strings else "value"
            end = pos + p.nbytes
            parts.append(Part(f"kv:{name}:{role}", pos, end, None if role in ("key", "str") else _fmt(p.dtype)))
            pos = end
        kvs[name] = (int(f.offset), pos)
        kv_end = pos
    tensors, tensor_parts = {}, {}
    header_end = kv_end
    for t in r.tensors:
        pos = int(t.field.offset)
        roles = {}
        for role, p in zip(_TENSOR_ROLES, t.field.parts):
            end = pos + p.nbytes
            roles[role] = (pos, end)
            if role == "dims":
                parts += [Part(f"tensor:{t.name}:dim{i}", q, q + 8, "<Q") for i, q in enumerate(range(pos, end, 8))]
            else:
                parts.append(Part(f"tensor:{t.name}:{role}", pos, end, None if role == "name" else _fmt(p.dtype)))
            pos = end
        tensors[t.name] = (int(t.field.offset), pos)
        tensor_parts[t.name] = roles
        header_end = pos
    return Layout(data, tuple(parts), kvs, tensors, tensor_parts, kv_end, header_end, int(r.data_offset))


# ---------------------------------------------------------------- encoding

def string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(vtype: int, v, etype: int | None = None) -> bytes:
    """The bytes of a value of GGUF type ``vtype`` (without the type); an array is ``(etype, list)`` or a list with
    ``etype`` given."""
    if vtype == STR:
        return string(v)
    if vtype == ARR:
        if etype is None:
            etype, v = v
        out = struct.pack("<IQ", etype, len(v))
        for x in v:
            out += value(etype, x[1], x[0]) if etype == ARR else value(etype, x)
        return out
    return struct.pack(_FMT[vtype], v)


def kv(key: str, vtype: int, v, etype: int | None = None) -> bytes:
    """A whole key/value: key, type, value."""
    return string(key) + struct.pack("<I", vtype) + value(vtype, v, etype)


# ---------------------------------------------------------------- editing

def rebuild(lay: Layout, header: bytes, align: int = 32, n_tensors: int | None = None, n_kv: int | None = None,
            data: bytes | None = None) -> bytes:
    """``header`` (from the magic to the end of the tensor infos) padded with zeros to ``align``, then the tensor
    data of ``lay`` (or ``data``); the counts at bytes 8..24 replaced where given."""
    h = bytearray(header)
    if n_tensors is not None:
        h[8:16] = struct.pack("<Q", n_tensors)
    if n_kv is not None:
        h[16:24] = struct.pack("<Q", n_kv)
    pad = (-len(h)) % align
    return bytes(h) + b"\0" * pad + (lay.data[lay.data_offset:] if data is None else data)


def header(lay: Layout) -> bytes:
    return lay.data[:lay.header_end]


def replace_kv(lay: Layout, key: str, new: bytes) -> bytes:
    """The file with key/value ``key`` replaced by the bytes ``new`` (a whole key/value, `kv`)."""
    a, b = lay.kv[key]
    return rebuild(lay, lay.data[:a] + new + lay.data[b:lay.header_end])


def add_kv(lay: Layout, new: bytes, align: int = 32) -> bytes:
    """The file with the key/value bytes ``new`` appended after the last one (the key count raised by one)."""
    h = header(lay)
    return rebuild(lay, h[:lay.kv_end] + new + h[lay.kv_end:], align=align, n_kv=lay.n_kv + 1)


def drop_kv(lay: Layout, key: str) -> bytes:
    a, b = lay.kv[key]
    return rebuild(lay, lay.data[:a] + lay.data[b:lay.header_end], n_kv=lay.n_kv - 1)


def set_field(data: bytes, part: Part, v) -> bytes:
    """``data`` with the number in ``part`` set to ``v`` (same width; ``v`` masked to it for unsigned formats)."""
    if part.fmt is None:
        raise ValueError(f"{part.label} is not a number")
    n = part.end - part.start
    if part.fmt[1:] in ("B", "H", "I", "Q"):
        v = int(v) & ((1 << (8 * n)) - 1)
    elif part.fmt[1:] in ("b", "h", "i", "q"):
        v = (int(v) + (1 << (8 * n - 1))) % (1 << (8 * n)) - (1 << (8 * n - 1))
    elif part.fmt[1:] == "?":
        v = bool(v)
    return data[:part.start] + struct.pack(part.fmt, v) + data[part.end:]


def get_field(data: bytes, part: Part):
    return struct.unpack_from(part.fmt, data, part.start)[0]


def part(lay: Layout, label: str) -> Part:
    return next(p for p in lay.parts if p.label == label)


# ---------------------------------------------------------------- tiny valid files of the dense families

TINY = dict(D=32, H=2, HKV=1, HD=16, F=64, V=64, L=2)


def tiny_dense(path: str | Path, arch: str, seed: int = 0) -> Path:
    """Write a tiny random float32 model of a dense family (``llama``, ``qwen2`` with Q/K/V biases, ``gemma3`` with
    q/k norms and post norms; `TINY` geometry, tied head) holding the tensors its family reads (the fixtures of
    the other families come from HF models: tests/fixtures/hybrid). Returns ``path``."""
    import gguf
    import numpy as np

    D, H, HKV, HD, F, V, L = (TINY[k] for k in ("D", "H", "HKV", "HD", "F", "V", "L"))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_context_length(256)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        w.add_key_length(HD)
    r = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
    ones = lambda n: np.ones(n, np.float32)
    w.add_tensor("token_embd.weight", r(V, D))
    w.add_tensor("output_norm.weight", ones(D))
    for i in range(L):
        b = f"blk.{i}."
        for name, a in [("attn_norm.weight", ones(D)), ("attn_q.weight", r(H * HD, D)), ("attn_k.weight", r(HKV * HD, D)),
                        ("attn_v.weight", r(HKV * HD, D)), ("attn_output.weight", r(D, H * HD)),
                        ("ffn_norm.weight", ones(D)), ("ffn_gate.weight", r(F, D)), ("ffn_up.weight", r(F, D)),
                        ("ffn_down.weight", r(D, F))]:
            w.add_tensor(b + name, a)
        if arch == "qwen2":
            for p, n in (("q", H * HD), ("k", HKV * HD), ("v", HKV * HD)):
                w.add_tensor(b + f"attn_{p}.bias", r(n))
        if arch == "gemma3":
            for name, n in (("attn_q_norm", HD), ("attn_k_norm", HD), ("post_attention_norm", D),
                            ("post_ffw_norm", D)):
                w.add_tensor(b + name + ".weight", ones(n))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
