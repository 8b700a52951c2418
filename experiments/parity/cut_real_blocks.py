"""Cut a few rows of one real tensor per (model file, block format) into tests/data/real_blocks.npz.

The fixture feeds tests/test_blocks.py, which checks `strata_jax.gguf.blocks.dequantize` against
`gguf.quants.dequantize` bit for bit on real weights. For every GGUF file in the model cache and every block format
found in it, the smallest-row 2-D tensor of that format (or a 1-D one when the format only has 1-D tensors) gives
up to 4 rows (first, second, middle, last), capped at ~64 KiB per cut.

npz layout, for cut i: ``{i}_raw`` uint8 [rows, row_bytes] (or [row_bytes] for a 1-D tensor), ``{i}_qtype`` int
(ggml type id), ``{i}_ncols`` int, ``{i}_source`` str ("file.gguf:tensor[rows]").

Usage: python experiments/parity/cut_real_blocks.py [--models DIR] [--out tests/data/real_blocks.npz]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from strata_jax.gguf import open_gguf  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
MAX_BYTES = 64 * 1024


def cut(path: str):
    g = open_gguf(path)
    by_type: dict = {}
    for t in g.tensors.values():
        by_type.setdefault(t.qtype, []).append(t)
    for qtype, ts in sorted(by_type.items(), key=lambda kv: kv[0].value):
        two_d = [t for t in ts if len(t.shape) == 2]
        t = min(two_d or ts, key=lambda t: (t.shape[-1], t.name))
        raw = g.tensor_bytes(t.name)
        if raw.ndim == 1:
            rows_desc = ""
            data = np.array(raw[: min(raw.shape[0], MAX_BYTES)])
            n_cols = t.shape[-1]
            if data.shape[0] != raw.shape[0]:  # 1-D tensor too large: keep whole blocks
                from gguf.constants import GGML_QUANT_SIZES
                block, size = GGML_QUANT_SIZES[qtype]
                n_blocks = MAX_BYTES // size
                data, n_cols = np.array(raw[: n_blocks * size]), n_blocks * block
                rows_desc = f"[:{n_cols}]"
        else:
            raw2 = raw.reshape(-1, raw.shape[-1])
            n = raw2.shape[0]
            rows = sorted({0, 1, n // 2, n - 1})
            rows = rows[: max(1, min(4, MAX_BYTES // raw2.shape[-1]))]
            data = np.array(raw2[rows])
            n_cols = t.shape[-1]
            rows_desc = str(rows)
        yield dict(raw=data, qtype=int(qtype.value), ncols=int(n_cols),
                   source=f"{os.path.basename(path)}:{t.name}{rows_desc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=os.path.expanduser("~/.cache/strata_jax/models"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data",
                                                  "real_blocks.npz"))
    args = ap.parse_args()
    arrays = {}
    i = 0
    for m in MODELS:
        path = os.path.join(args.models, f"{m}.gguf")
        if not os.path.exists(path):
            print(f"skip {path} (missing)")
            continue
        for c in cut(path):
            for k, v in c.items():
                arrays[f"{i}_{k}"] = np.asarray(v)
            print(f"{i}: {c['source']} qtype={c['qtype']} ncols={c['ncols']} bytes={c['raw'].nbytes}")
            i += 1
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {i} cuts to {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
