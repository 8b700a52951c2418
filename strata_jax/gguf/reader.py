"""A streaming GGUF header parser with memory-mapped tensor data.

Format: the GGUF specification (ggml's docs/gguf.md, versions 2 and 3): magic ``GGUF``, version, tensor count,
metadata count, then the metadata key/values, then the tensor infos (name, dims in ggml ``ne`` order, type, offset),
then tensor data aligned to ``general.alignment`` (default 32).

Why our own parser: ``gguf.GGUFReader`` builds numpy views for every field (16 s for Gemma 3's 262k-token header on a
2-core machine). Here numeric arrays become one ``np.frombuffer`` each and string arrays are decoded in one pass over
the memory map, so the same header reads in well under 2 s. Tensor data is never copied: ``GGUFFile.tensor_bytes``
returns a read-only view into the memory map.

Files come from strangers, so every field is validated as it is read (see `GGUFFile`; limits after ggml's
``gguf.cpp``): a file is refused with one `StrataError` line, or it is a consistent set of tensors inside the file.
Typed reads of the metadata values are in `strata_jax.gguf.metadata`.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from strata_jax.errors import StrataError
from strata_jax.gguf.metadata import get_str, key_error, short_repr

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS: ggml tensors have at most 4 dims
# Bounds that keep a small file from costing a large allocation or a long parse (real files: ~30-60 keys, a few
# thousand tensors, under a million array strings - Gemma 3's 262k tokens - and no nested arrays).
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 18
MAX_ARRAY_DEPTH = 4  # an array of arrays is depth 2 (ggml's gguf.cpp refuses any nesting)
MAX_ARRAY_OBJECTS = 1 << 22  # strings and sub-arrays inside metadata arrays, over the whole file
MAX_SUBARRAYS = 1 << 16  # sub-arrays inside metadata arrays, over the whole file
_MAX_INT64 = (1 << 63) - 1

# GGUF metadata value types (gguf spec).
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR = {
    _UINT8: ("<B", 1), _INT8: ("<b", 1), _UINT16: ("<H", 2), _INT16: ("<h", 2), _UINT32: ("<I", 4),
    _INT32: ("<i", 4), _FLOAT32: ("<f", 4), _BOOL: ("<?", 1), _UINT64: ("<Q", 8), _INT64: ("<q", 8),
    _FLOAT64: ("<d", 8),
}
_NP = {
    _UINT8: np.uint8, _INT8: np.int8, _UINT16: np.uint16, _INT16: np.int16, _UINT32: np.uint32, _INT32: np.int32,
    _FLOAT32: np.float32, _BOOL: np.bool_, _UINT64: np.uint64, _INT64: np.int64, _FLOAT64: np.float64,
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    Attributes:
      name: the GGUF tensor name, e.g. ``blk.0.attn_q.weight``.
      shape: the numpy shape (the reverse of ggml's ``ne``): ``(rows, cols)`` for a matrix, the last axis being the
        one blocks run along.
      qtype: the ggml block format (``gguf.GGMLQuantizationType``).
      offset: byte offset of the data from the start of the file.
      nbytes: bytes of data.
    """

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class _Cursor:
    """Sequential reads from a buffer (the memory map) with bounds checks that name the truncation, and the
    metadata array budgets (`MAX_ARRAY_DEPTH`, `MAX_ARRAY_OBJECTS`, `MAX_SUBARRAYS`)."""

    def __init__(self, buf, path: str):
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size = len(buf)
        self.where = ""  # what is being read, for messages (e.g. "metadata key 'x'")
        self.objects = 0  # strings and sub-arrays read from metadata arrays so far
        self.subarrays = 0

    def fail(self, problem: str):
        raise StrataError(f"{self.path}: {problem}" + (f" ({self.where})" if self.where else ""))

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            self.fail(f"truncated GGUF header (needs {self.pos + n} bytes, file has {self.size})")

    def scalar(self, vtype: int):
        fmt, n = _SCALAR[vtype]
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self) -> int:
        return self.scalar(_UINT32)

    def u64(self) -> int:
        return self.scalar(_UINT64)

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(depth + 1)
        if vtype not in _SCALAR:
            self.fail(f"unknown GGUF value type {vtype}")
        return self.scalar(vtype)

    def _spend(self, count: int, subarrays: bool = False) -> None:
        """Charge ``count`` Python objects (strings or sub-arrays) to the file's budget before reading them."""
        self.objects += count
        if self.objects > MAX_ARRAY_OBJECTS:
            self.fail(f"metadata arrays hold more than {MAX_ARRAY_OBJECTS} strings and sub-arrays")
        if subarrays:
            self.subarrays += count
            if self.subarrays > MAX_SUBARRAYS:
                self.fail(f"metadata arrays hold more than {MAX_SUBARRAYS} nested arrays")

    def array(self, depth: int):
        if depth > MAX_ARRAY_DEPTH:
            self.fail(f"metadata arrays nested more than {MAX_ARRAY_DEPTH} deep")
        etype = self.u32()
        count = self.u64()
        if etype == _STRING:
            self.need(count * 8)  # every string has its 8-byte length: refuse an absurd count before the loop
            self._spend(count)
            return self._string_array(count)
        if etype == _ARRAY:
            self.need(count * 12)  # every sub-array has its type and count
            self._spend(count, subarrays=True)
            return [self.array(depth + 1) for _ in range(count)]
        if etype not in _NP:
            self.fail(f"unknown GGUF array element type {etype}")
        dt = np.dtype(_NP[etype]).newbyteorder("<")
        n = count * dt.itemsize
        self.need(n)
        arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
        self.pos += n
        return arr

    def _string_array(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        unpack = struct.Struct("<Q").unpack_from
        size = self.size
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8)
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                self.need(n)
            out.append(buf[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out


class GGUFFile:
    """An open GGUF file: metadata, tensor table, and memory-mapped tensor data.

    The header is validated as it is read (limits after ggml's ``gguf.cpp``): version 2 or 3 and little-endian;
    key and tensor counts that fit in the file (and at most `MAX_KEYS` / `MAX_TENSORS`); no empty or duplicate key;
    metadata arrays at most `MAX_ARRAY_DEPTH` deep holding at most `MAX_ARRAY_OBJECTS` strings and sub-arrays
    (`MAX_SUBARRAYS` of them sub-arrays) in all; ``general.alignment`` a positive power of two of an integer type
    (default 32); per tensor a unique non-empty UTF-8 name, at most `MAX_DIMS` dims each >= 1, a known block format
    whose block divides the row, an offset on the alignment, and data inside the file that overlaps no other
    tensor's. Sizes are Python ints (no overflow).

    Args:
      path: the file's path.
      header_only: accept a file cut at the start of the tensor data (a header copy, for building same-shape
        random-weight files); tensor bytes are then unavailable.

    Attributes:
      path: the path.
      version: GGUF version (2 or 3).
      metadata: key -> value (int/float/bool/str, numpy arrays for numeric arrays, lists of str for string arrays,
        lists for arrays of arrays). Read typed values with `strata_jax.gguf.metadata`.
      tensors: name -> `TensorInfo`, in file order.
      data_offset: where tensor data starts.
      alignment: ``general.alignment`` (tensor offsets are multiples of it).

    Raises:
      StrataError: the file is missing or unreadable, is not GGUF, is big-endian, is truncated (header or tensor
        data), or breaks one of the rules above; the message is one line naming the file and the problem, and no
        map is left open.
    """

    def __init__(self, path: str | os.PathLike, header_only: bool = False):
        self.path = str(path)
        if not os.path.exists(self.path):
            raise StrataError(f"{self.path}: no such file")
        if os.path.isdir(self.path):
            raise StrataError(f"{self.path}: is a directory, not a GGUF file")
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 24:
                    raise StrataError(f"{self.path}: not a GGUF file (only {size} bytes)")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise StrataError(f"{self.path}: cannot read the file ({e.strerror or e})") from None
        try:
            self._parse(size, header_only)
        except BaseException:
            try:
                self._mm.close()  # nothing half-loaded: no view of the map has been handed out yet
            except BufferError:
                pass
            raise

    def _parse(self, size: int, header_only: bool) -> None:
        if self._mm[:4] != GGUF_MAGIC:
            raise StrataError(f"{self.path}: not a GGUF file (magic {bytes(self._mm[:4])!r}, expected b'GGUF')")
        c = _Cursor(self._mm, self.path)
        c.pos = 4
        self.version = c.u32()
        if self.version not in (2, 3):
            if struct.unpack_from(">I", self._mm, 4)[0] in (1, 2, 3):
                raise StrataError(f"{self.path}: big-endian GGUF files are not supported (convert it with gguf-py's "
                                  "`gguf-convert-endian FILE little`)")
            raise StrataError(f"{self.path}: unsupported GGUF version {self.version} (2 and 3 are read)")
        n_tensors = c.u64()
        n_kv = c.u64()
        # each key costs >= 13 bytes (length, one byte of name, type) and each tensor info >= 24: refuse counts
        # the file cannot hold before reading any
        if n_kv > MAX_KEYS or n_tensors > MAX_TENSORS or 13 * n_kv + 24 * n_tensors > size - c.pos:
            if n_kv <= MAX_KEYS and n_tensors <= MAX_TENSORS:  # plausible counts, too few bytes: a cut file
                raise StrataError(f"{self.path}: truncated GGUF file ({size} bytes cannot hold the header's "
                                  f"{n_tensors} tensors and {n_kv} metadata keys)")
            raise StrataError(f"{self.path}: corrupt GGUF header ({n_tensors} tensors and {n_kv} metadata keys "
                              f"in a {size}-byte file; at most {MAX_TENSORS} and {MAX_KEYS} are read)")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            c.where = f"metadata key {i}"
            key = c.string()
            if not key:
                c.fail("empty metadata key")
            if key in self.metadata:
                raise StrataError(f"{self.path}: duplicate metadata key {short_repr(key)}")
            c.where = f"metadata key {short_repr(key)}"
            vtype = c.u32()
            self.metadata[key] = c.value(vtype)
        c.where = ""
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
            raise key_error(self, "general.alignment", "a positive power of two of an integer type", align)
        self.alignment = align
        infos = []
        names = set()
        for i in range(n_tensors):
            c.where = f"tensor info {i}"
            name = self._tensor_name(c)
            if name in names:
                raise StrataError(f"{self.path}: duplicate tensor name {short_repr(name)}")
            names.add(name)
            c.where = f"tensor {short_repr(name)}"
            n_dims = c.u32()
            if n_dims > MAX_DIMS:
                c.fail(f"{n_dims} dims (at most {MAX_DIMS})")
            ne = [c.u64() for _ in range(n_dims)]
            if any(d < 1 for d in ne):
                c.fail(f"dims {ne} (ggml order): every dim must be >= 1")
            tcode = c.u32()
            offset = c.u64()
            try:
                qtype = GGMLQuantizationType(tcode)
                block, bsize = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                c.fail(f"unknown block format id {tcode}")
            row = ne[0] if ne else 1
            if row % block:
                c.fail(f"row of {row} is no multiple of the {qtype.name} block ({block})")
            if offset % align:
                c.fail(f"data offset {offset} is not on the {align}-byte alignment")
            infos.append((name, tuple(reversed(ne)), qtype, offset, math.prod(ne) // block * bsize))
        c.where = ""
        self.data_offset = (c.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset, nbytes in infos:
            start = self.data_offset + offset
            if (start + nbytes > size and not header_only) or start + nbytes > _MAX_INT64:
                raise StrataError(f"{self.path}: tensor {short_repr(name)} ({qtype.name}, shape {shape}) ends at byte "
                                  f"{start + nbytes}, beyond the end of the file ({size} bytes): truncated GGUF file "
                                  "or corrupt tensor info")
            self.tensors[name] = TensorInfo(name, shape, qtype, start, nbytes)
        prev = None
        for t in sorted(self.tensors.values(), key=lambda t: t.offset):
            if prev is not None and t.offset < prev.offset + prev.nbytes:
                raise StrataError(f"{self.path}: tensors {short_repr(prev.name)} (bytes {prev.offset}.."
                                  f"{prev.offset + prev.nbytes}) and {short_repr(t.name)} (from byte {t.offset}) "
                                  "overlap")
            prev = t

    def _tensor_name(self, c: _Cursor) -> str:
        n = c.u64()
        c.need(n)
        try:
            name = bytes(self._mm[c.pos:c.pos + n]).decode("utf-8")
        except UnicodeDecodeError:
            c.fail("tensor name is not UTF-8")
        c.pos += n
        if not name:
            c.fail("empty tensor name")
        return name

    @property
    def architecture(self) -> str:
        return get_str(self, "general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of tensor ``name`` as a read-only uint8 view into the memory map (no copy).

        Returns:
          uint8 array of shape ``(*shape[:-1], bytes_per_row)``; for F32/F16/BF16 view it with the matching dtype.

        Raises:
          StrataError: no tensor of that name, or its data is not in the file (opened ``header_only``).
        """
        t = self.info(name)
        if t.offset + t.nbytes > len(self._mm):
            raise StrataError(f"{self.path}: tensor {name!r} has no data in this file (opened as a header copy)")
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        block, bsize = GGML_QUANT_SIZES[t.qtype]
        if not t.shape:
            return arr
        row_bytes = t.shape[-1] // block * bsize
        return arr.reshape(*t.shape[:-1], row_bytes)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise StrataError(f"{self.path}: tensor {name!r} is missing from the GGUF file") from None

    def has(self, name: str) -> bool:
        return name in self.tensors

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass  # a view into the map is still alive; the map closes when it is collected


def open_gguf(path: str | os.PathLike, header_only: bool = False) -> GGUFFile:
    """Open a GGUF file (see `GGUFFile`)."""
    return GGUFFile(path, header_only)
