"""A streaming GGUF header parser with memory-mapped tensor data.

Format: the GGUF specification (ggml's docs/gguf.md, versions 2 and 3): magic ``GGUF``, version, tensor count,
metadata count, then the metadata key/values, then the tensor infos (name, dims in ggml ``ne`` order, type, offset),
then tensor data aligned to ``general.alignment`` (default 32).

Why our own parser: ``gguf.GGUFReader`` builds numpy views for every field (16 s for Gemma 3's 262k-token header on a
2-core machine). Here numeric arrays become one ``np.frombuffer`` each and string arrays are decoded in one pass over
the memory map, so the same header reads in well under 2 s. Tensor data is never copied: ``GGUFFile.tensor_bytes``
returns a read-only view into the memory map.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from strata_jax.errors import StrataError

GGUF_MAGIC = b"GGUF"

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
        return int(np.prod(self.shape)) if self.shape else 1


class _Cursor:
    """Sequential reads from a buffer (the memory map) with bounds checks that name the truncation."""

    def __init__(self, buf, path: str):
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size = len(buf)

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise StrataError(f"{self.path}: truncated GGUF header (needs {self.pos + n} bytes, file has {self.size})")

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

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.u32()
            count = self.u64()
            if etype == _STRING:
                return self._string_array(count)
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            if etype not in _NP:
                raise StrataError(f"{self.path}: unknown GGUF array element type {etype}")
            dt = np.dtype(_NP[etype]).newbyteorder("<")
            n = count * dt.itemsize
            self.need(n)
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
            self.pos += n
            return arr
        if vtype not in _SCALAR:
            raise StrataError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.scalar(vtype)

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

    Args:
      path: the file's path.
      header_only: accept a file cut at the start of the tensor data (a header copy, for building same-shape
        random-weight files); tensor bytes are then unavailable.

    Attributes:
      path: the path.
      version: GGUF version (2 or 3).
      metadata: key -> value (int/float/bool/str, numpy arrays for numeric arrays, lists of str for string arrays).
      tensors: name -> `TensorInfo`, in file order.
      data_offset: where tensor data starts.

    Raises:
      StrataError: the file is missing, is not GGUF, is truncated (header or tensor data), or names an unknown
        block format.
    """

    def __init__(self, path: str | os.PathLike, header_only: bool = False):
        self.path = str(path)
        if not os.path.exists(self.path):
            raise StrataError(f"{self.path}: no such file")
        if os.path.isdir(self.path):
            raise StrataError(f"{self.path}: is a directory, not a GGUF file")
        size = os.path.getsize(self.path)
        if size < 24:
            raise StrataError(f"{self.path}: not a GGUF file (only {size} bytes)")
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._mm[:4] != GGUF_MAGIC:
            raise StrataError(f"{self.path}: not a GGUF file (magic {bytes(self._mm[:4])!r}, expected b'GGUF')")
        c = _Cursor(self._mm, self.path)
        c.pos = 4
        self.version = c.u32()
        if self.version not in (2, 3):
            raise StrataError(f"{self.path}: unsupported GGUF version {self.version} (2 and 3 are read)")
        n_tensors = c.u64()
        n_kv = c.u64()
        if n_tensors > 10_000_000 or n_kv > 10_000_000:
            raise StrataError(f"{self.path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            vtype = c.u32()
            self.metadata[key] = c.value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.u32()
            if n_dims > 8:
                raise StrataError(f"{self.path}: corrupt tensor info for {name!r} ({n_dims} dims)")
            ne = [c.u64() for _ in range(n_dims)]
            tcode = c.u32()
            offset = c.u64()
            try:
                qtype = GGMLQuantizationType(tcode)
            except ValueError:
                raise StrataError(f"{self.path}: tensor {name!r} has unknown block format id {tcode}") from None
            infos.append((name, tuple(reversed(ne)), qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        self.data_offset = (c.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in infos:
            block, bsize = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape)) if shape else 1
            if shape and shape[-1] % block:
                raise StrataError(f"{self.path}: tensor {name!r} row of {shape[-1]} is no multiple of the "
                                  f"{qtype.name} block ({block})")
            nbytes = n // block * bsize
            start = self.data_offset + offset
            if start + nbytes > size and not header_only:
                raise StrataError(f"{self.path}: truncated GGUF file (tensor {name!r} ends at byte {start + nbytes}, "
                                  f"file has {size})")
            self.tensors[name] = TensorInfo(name, shape, qtype, start, nbytes)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise StrataError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of tensor ``name`` as a read-only uint8 view into the memory map (no copy).

        Returns:
          uint8 array of shape ``(*shape[:-1], bytes_per_row)``; for F32/F16/BF16 view it with the matching dtype.

        Raises:
          StrataError: no tensor of that name.
        """
        t = self.info(name)
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
