"""The random-weight geometries used by the full-size speed runs (`strata_jax.testing.random_weights.VirtualGGUF`,
`strata_jax.testing.random_gguf`): every tensor the loader asks for is there with the geometry's shape and block
format, and random blocks dequantize (by `gguf.quants`, the independent oracle) to small finite values."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from strata_jax.models.registry import config_from_gguf
from strata_jax.errors import StrataError
from strata_jax.gguf import open_gguf
from strata_jax.testing import random_gguf
from strata_jax.testing.random_weights import RANDOM_SCALE, SCALE_BYTES, VirtualGGUF, load_geometry

# largest |value| a random block can give: the fp16 super-scale * 128 (Q6_K's int8 sub-scale) * 32 (its 6-bit code)
BOUND = float(np.float16(RANDOM_SCALE)) * 128 * 32


@pytest.mark.parametrize("name", ["qwen3.8-flash-next", "qwen3.6-35b-a3b", "qwen3-next-80b-a3b"])
def test_geometry_tables_and_config(name):
    geom = load_geometry(name)
    v = VirtualGGUF(geom, mtp=True)
    cfg = config_from_gguf(v)
    assert cfg.arch == geom["arch"] and cfg.n_layer == geom["n_layer"] and cfg.n_nextn == 1
    assert cfg.n_expert == geom["experts"] and cfg.n_embd == geom["hidden"] and cfg.vocab_size == geom["vocab"]
    E, F, D = geom["experts"], geom["expert_ff"], geom["hidden"]
    gate = v.info("blk.0.ffn_gate_exps.weight")
    assert gate.shape == (E, F, D) and gate.qtype == Q[geom["quant"]["exp_gate_up"]]
    assert v.info(f"blk.{geom['n_layer']}.nextn.eh_proj.weight" if geom["arch"] != "qwen4exp"
                  else f"blk.{geom['n_layer']}.ffn_gate_exps.weight")
    # the bytes the table promises are the block format's bytes
    for t in v.tensors.values():
        block, bsize = GGML_QUANT_SIZES[t.qtype]
        assert t.nbytes == int(np.prod(t.shape)) // block * bsize


def test_random_blocks_dequantize_small_and_finite():
    geom = dict(load_geometry("qwen3.8-flash-next"), experts=4)  # 4 experts: the stacked expert tensors stay small
    v = VirtualGGUF(geom, n_layer=4)
    seen = set()
    for t in sorted(v.tensors.values(), key=lambda t: t.nbytes):  # the smallest tensor of each format
        if t.qtype in seen:
            continue
        seen.add(t.qtype)
        raw = np.asarray(v.tensor_bytes(t.name))
        if t.qtype in (Q.F32, Q.F16, Q.BF16):
            vals = raw.view({Q.F32: np.float32, Q.F16: np.float16}.get(t.qtype, np.uint16))
            if t.qtype == Q.BF16:
                vals = (vals.astype(np.uint32) << 16).view(np.float32)
        else:
            vals = quants.dequantize(raw.reshape(-1, raw.shape[-1]), t.qtype)
        vals = np.asarray(vals, np.float64)
        assert np.isfinite(vals).all(), (t.name, t.qtype.name)
        if t.qtype in SCALE_BYTES:  # blocks: random codes and sub-scales under the fixed 0.002 super-scale
            assert np.abs(vals).max() <= BOUND and vals.std() > 0, (t.name, t.qtype.name)
        else:  # floats: ones (norms), -|N(0,1)| (ssm_a) or N(0, 0.02^2)
            assert np.abs(vals).max() < 8.0, (t.name, t.qtype.name)
    assert {Q.Q2_K, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.BF16, Q.F32} <= seen


def test_random_gguf_fill_round_trip(tmp_path, model_path):
    """`strata_jax.testing.random_gguf`: header of a real file + random data = a file with the same table whose
    blocks dequantize small and finite."""
    src = model_path("smollm2-135m")
    hdr, out = tmp_path / "h.bin", tmp_path / "r.gguf"
    random_gguf.write_header(src, str(hdr))
    assert hdr.stat().st_size < os.path.getsize(src) // 10
    random_gguf.fill(str(hdr), str(out))
    a, b = open_gguf(src), open_gguf(str(out))
    assert {n: (t.shape, t.qtype) for n, t in a.tensors.items()} == {n: (t.shape, t.qtype) for n, t in b.tensors.items()}
    checked = 0
    for t in b.tensors.values():
        if t.qtype in SCALE_BYTES and t.nbytes < 4 << 20:
            raw = b.tensor_bytes(t.name)
            vals = quants.dequantize(raw.reshape(-1, raw.shape[-1]), t.qtype)
            assert np.isfinite(vals).all() and np.abs(vals).max() <= BOUND and vals.std() > 0, t.name
            checked += 1
    assert checked > 0
    # an xz-compressed header (how experiments/data keeps them) fills the same file
    hxz, out2 = tmp_path / "h.bin.xz", tmp_path / "r2.gguf"
    random_gguf.write_header(src, str(hxz))
    assert hxz.stat().st_size < hdr.stat().st_size
    random_gguf.fill(str(hxz), str(out2))
    assert out2.read_bytes() == out.read_bytes()


def test_unknown_geometry():
    with pytest.raises(StrataError, match="unknown geometry"):
        load_geometry("no-such-model")
