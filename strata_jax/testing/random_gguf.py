"""Same-shape random-weight GGUF files, for speed runs where the real file cannot travel.

``python -m strata_jax.testing.random_gguf header SRC.gguf HEADER[.xz]``: copy SRC's header (metadata, tokenizer,
tensor table) up to the start of its tensor data; a few MB instead of the whole file (xz-compressed when the name
ends in ``.xz``: the Qwen2.5 headers in experiments/data are 6 MB plain, 1.3 MB compressed).
``python -m strata_jax.testing.random_gguf fill HEADER[.xz] OUT.gguf``: write OUT = that header + random tensor data
whose block scales are small and finite (every block format our reader knows keeps its layout), so decode runs over
the real shapes and block formats at the real byte counts. Norm weights are ones.
"""

from __future__ import annotations

import lzma
import os
import sys
import tempfile

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from strata_jax.gguf import open_gguf
from strata_jax.testing.random_weights import SCALE_BYTES, scale_pattern


def write_header(src: str, out: str) -> None:
    """Copy ``src``'s header (everything before its tensor data) to ``out``, xz-compressed if ``out`` ends in .xz."""
    g = open_gguf(src)
    with open(src, "rb") as f, (lzma.open if out.endswith(".xz") else open)(out, "wb") as o:
        o.write(f.read(g.data_offset))


def header_file(path: str) -> str:
    """A plain (memory-mappable) header file for ``path``: ``path`` itself, or for ``*.xz`` its decompressed copy in
    the temp folder (made once; reused while it is newer than the compressed file)."""
    path = str(path)
    if not path.endswith(".xz"):
        return path
    plain = os.path.join(tempfile.gettempdir(), "strata_jax_headers", os.path.basename(path)[:-3])
    if not os.path.exists(plain) or os.path.getmtime(plain) < os.path.getmtime(path):
        os.makedirs(os.path.dirname(plain), exist_ok=True)
        part = f"{plain}.{os.getpid()}.partial"
        with lzma.open(path, "rb") as f, open(part, "wb") as o:
            o.write(f.read())
        os.replace(part, plain)
    return plain


def fill(header: str, out: str, seed: int = 0) -> int:
    """Write ``out`` = the header file ``header`` (plain or .xz) + random tensor data (module docstring); returns
    the file's size in bytes."""
    header = header_file(header)
    g = open_gguf(header, header_only=True)
    end = max(t.offset + t.nbytes for t in g.tensors.values())
    with open(header, "rb") as f, open(out, "wb") as o:
        o.write(f.read(g.data_offset))
        o.truncate(end)
    mm = np.memmap(out, dtype=np.uint8, mode="r+")
    rng = np.random.default_rng(seed)
    scale = scale_pattern()
    for t in g.tensors.values():
        a = mm[t.offset:t.offset + t.nbytes]
        if t.qtype == Q.F32:
            v = np.ones(t.nbytes // 4, np.float32) if "norm" in t.name else (rng.standard_normal(t.nbytes // 4) * 0.02).astype(np.float32)
            a.view(np.float32)[:] = v
        elif t.qtype in (Q.F16, Q.BF16):
            v = (rng.standard_normal(t.nbytes // 2) * 0.02).astype(np.float32)
            a.view(np.uint16)[:] = (v.astype(np.float16).view(np.uint16) if t.qtype == Q.F16
                                    else (v.view(np.uint32) >> 16).astype(np.uint16))
        else:
            if t.qtype not in SCALE_BYTES:
                raise SystemExit(f"{t.name}: block format {t.qtype.name} not handled")
            a[:] = rng.integers(0, 256, t.nbytes, dtype=np.uint8)
            b = a.reshape(-1, GGML_QUANT_SIZES[t.qtype][1])
            for lo, hi in SCALE_BYTES[t.qtype]:
                b[:, lo:hi] = np.tile(scale, (hi - lo) // 2)
    mm.flush()
    return end


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("header", "fill"), help="header SRC HEADER, or fill HEADER OUT")
    ap.add_argument("src")
    ap.add_argument("dst")
    a = ap.parse_args(argv)
    if a.command == "header":
        write_header(a.src, a.dst)
    else:
        print("wrote", a.dst, fill(a.src, a.dst), "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
