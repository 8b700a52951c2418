"""Append an MTP draft block to a tiny hybrid GGUF (test fixtures for MTP proposals on a whole model).

The tiny parity fixtures (``experiments/parity/make_hybrid_fixtures.py``) come from HF models, which have no MTP
module, so they carry no MTP tensors. `add_mtp_block` copies such a file and appends block ``n_layer``: the
attention + MoE tensors of the trunk's last full-attention layer (the draft block has that layer's shape; qwen4exp's
indexer and PLE tensors are left out) plus random MTP projections and norms in the names `strata_jax.layers.mtp` reads:
  qwen35moe / qwen3next: ``blk.n.nextn.{eh_proj,enorm,hnorm,shared_head_norm}``, ``attn_norm``,
    ``post_attention_norm`` (llama.cpp's ``nextn`` names);
  qwen4exp: ``blk.n.nextn.{enorm,hnorm,fc_embedding,fc_hidden}`` and the block's ``hc_attn_*`` / ``hc_ffn_*``.
``block_count`` grows by one and ``nextn_predict_layers`` = 1. Matrices are stored in the source's format of the
copied layer (F32 or Q8_0, quantized with ``gguf.quants``); the MTP weights are random (drafts are not expected to
be accepted: the fixture tests exactness and plumbing, not acceptance).

Usage: python -m strata_jax.testing.mtp_block SRC.gguf DST.gguf [--seed 0]
"""

from __future__ import annotations

import argparse

import numpy as np


def add_mtp_block(src: str, dst: str, seed: int = 0) -> str:
    """Write ``dst`` = ``src`` + one MTP block (see the module docstring). Returns ``dst``.

    Raises:
      ValueError: ``src`` is not a qwen35moe / qwen3next / qwen4exp file, or already has an MTP block.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q, GGUFValueType as VT

    r = gguf.GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    if arch not in ("qwen35moe", "qwen3next", "qwen4exp"):
        raise ValueError(f"{src}: architecture {arch!r} has no MTP block layout here")
    p = arch + "."
    if int(r.fields.get(p + "nextn_predict_layers").contents() if p + "nextn_predict_layers" in r.fields else 0):
        raise ValueError(f"{src}: already has an MTP block")
    n = int(r.fields[p + "block_count"].contents())
    interval = int(r.fields[p + "full_attention_interval"].contents()) if p + "full_attention_interval" in r.fields \
        else 4
    full = max(i for i in range(n) if (i + 1) % interval == 0)
    D = int(r.fields[p + "embedding_length"].contents())
    rng = np.random.default_rng(seed)

    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        val = f.contents()
        if name == p + "block_count":
            val = n + 1
        vt = f.types[0]
        w.add_key_value(name, val, vt, f.types[1] if vt == VT.ARRAY and len(f.types) > 1 else None)
    w.add_key_value(p + "nextn_predict_layers", 1, VT.UINT32)

    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    src_b, b = f"blk.{full}.", f"blk.{n}."
    mat_type = tensors[src_b + "attn_q.weight"].tensor_type
    skip = ("indexer.", "ple_")
    for name, t in tensors.items():
        if name.startswith(src_b) and not any(s in name for s in skip):
            if arch != "qwen4exp" and name.endswith(("attn_norm.weight", "post_attention_norm.weight")):
                continue  # written below (randomised, so the block is not a copy)
            w.add_tensor(b + name[len(src_b):], t.data, raw_dtype=t.tensor_type)

    def mat(rows, cols):
        a = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        if mat_type == Q.F32:
            return a, None
        return gguf.quants.quantize(a, mat_type), mat_type

    def norm(k):
        return (1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32)

    def put(name, arr_type):
        arr, qt = arr_type if isinstance(arr_type, tuple) else (arr_type, None)
        w.add_tensor(b + name, arr, raw_dtype=qt)

    if arch == "qwen4exp":
        hc = int(r.fields[p + "hyper_connection.count"].contents())
        put("nextn.enorm.weight", norm(D))
        put("nextn.hnorm.weight", norm(hc * D))
        put("nextn.fc_embedding.weight", mat(D, D))
        put("nextn.fc_hidden.weight", mat(D, D))
    else:
        put("nextn.eh_proj.weight", mat(D, 2 * D))
        for k in ("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm", "attn_norm", "post_attention_norm"):
            put(k + ".weight", norm(D))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(add_mtp_block(a.src, a.dst, a.seed))


if __name__ == "__main__":
    main()
