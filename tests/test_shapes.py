"""Tensors against the metadata (issue 18): a file whose keys are valid (type and range) but disagree with its tensors,
a tensor missing from the file, or one stored in a block format wrong for its role, is refused with one
`StrataError` line naming the file and the tensor (`strata_jax.layers.linear.check_tensor`, the one check) before
any tensor data is read (`strata_jax.models.registry.check_stages`, which the engine runs before placing weights).

Files are the tiny fixtures with one metadata key edited (tests/gguf_edit.py), tiny random dense files for llama /
qwen2 / gemma3 (`gguf_edit.tiny_dense`), fixtures with an MTP block appended (`strata_jax.testing.mtp_block`) whose
MTP tensor has its two dims swapped (the block's keys are the trunk's, so only a tensor can disagree there), and
the random-weight geometries (`strata_jax.testing.random_weights.VirtualGGUF`).
"""

from __future__ import annotations

import gguf_edit as E
import jax
import pytest
from flax import nnx

from strata_jax.errors import StrataError
from strata_jax.gguf import GGUFFile, open_gguf
from strata_jax.layers.linear import dry_run
from strata_jax.models.registry import build_stage, check_stages, config_from_gguf, mtp_head
from strata_jax.pipeline.engine import Engine

FIX = E.FIXTURE.parent


def _edited(tmp_path, lay, key, value, vtype=E.U32):
    """The file of ``lay`` with metadata ``key`` set to ``value`` (replaced or added)."""
    new = E.kv(key, vtype, value)
    p = tmp_path / "bad.gguf"
    p.write_bytes(E.replace_kv(lay, key, new) if key in lay.kv else E.add_kv(lay, new))
    return p


def _refusal(path) -> str:
    """The message of the engine's refusal of ``path`` (config read fine; the tensor check refuses)."""
    g = open_gguf(path)
    cfg = config_from_gguf(g)  # the edited keys are valid on their own
    with pytest.raises(StrataError) as e:
        Engine(g, max_context=16)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: tensor '"), msg
    # the real build (no dry run) refuses the same way, at the same tensor
    with pytest.raises(StrataError) as e2:
        build_stage(g, cfg, 0, cfg.n_layer)
    assert str(e2.value) == msg
    return msg


def _fixture(name):
    if name in ("llama", "qwen2", "gemma3"):
        return None
    return FIX / f"{name}_q8_0.gguf"


# (family, key, value, the message after "<file>: ")
SHAPE_CASES = [
    ("qwen3next", "attention.head_count", 2, "tensor 'blk.3.attn_q.weight' has shape [512, 256], the metadata "
     "expects [256, 256] (from qwen3next.attention.head_count=2, qwen3next.attention.key_length=64, "
     "qwen3next.embedding_length=256)"),
    ("qwen3next", "attention.key_length", 32, "tensor 'blk.3.attn_q.weight' has shape [512, 256], the metadata "
     "expects [256, 256]"),
    ("qwen3next", "ssm.state_size", 16, "tensor 'blk.0.attn_qkv.weight' has shape [512, 256], the metadata expects "
     "[384, 256] (from qwen3next.ssm.group_count=4, qwen3next.ssm.state_size=16, qwen3next.ssm.time_step_rank=8, "
     "qwen3next.ssm.inner_size=256, qwen3next.embedding_length=256)"),
    ("qwen3next", "ssm.group_count", 2, "tensor 'blk.0.attn_qkv.weight' has shape [512, 256], the metadata expects "
     "[384, 256]"),
    ("qwen3next", "ssm.conv_kernel", 3, "tensor 'blk.0.ssm_conv1d.weight' has shape [512, 4], the metadata expects "
     "[512, 3]"),
    ("qwen3next", "embedding_length", 128, "tensor 'token_embd.weight' has shape [512, 256], the metadata expects "
     "[512, 128] (from tokenizer.ggml.tokens (512 entries), qwen3next.embedding_length=128)"),
    ("qwen3next", "expert_count", 4, "tensor 'blk.0.ffn_gate_inp.weight' has shape [8, 256], the metadata expects "
     "[4, 256] (from qwen3next.expert_count=4, qwen3next.embedding_length=256)"),
    ("qwen3next", "expert_feed_forward_length", 16, "tensor 'blk.0.ffn_gate_exps.weight' has shape [8, 32, 256], "
     "the metadata expects [8, 16, 256]"),
    ("qwen3next", "expert_shared_feed_forward_length", 32, "tensor 'blk.0.ffn_gate_shexp.weight' has shape "
     "[64, 256], the metadata expects [32, 256]"),
    ("qwen3next", "vocab_size", 500, "tensor 'token_embd.weight' has shape [512, 256], the metadata expects "
     "[500, 256] (from qwen3next.vocab_size=500, qwen3next.embedding_length=256)"),
    ("qwen35moe", "attention.head_count_kv", 1, "tensor 'blk.3.attn_k.weight' has shape [128, 256], the metadata "
     "expects [64, 256] (from qwen35moe.attention.head_count_kv=1, qwen35moe.attention.key_length=64"),
    ("qwen35", "feed_forward_length", 96, "tensor 'blk.0.ffn_gate.weight' has shape [128, 64], the metadata "
     "expects [96, 64]"),
    ("qwen4exp", "hyper_connection.count", 2, "tensor 'blk.0.hc_attn_norm.weight' has shape [1024], the metadata "
     "expects [512] (from qwen4exp.hyper_connection.count=2, qwen4exp.embedding_length=256)"),
    ("qwen4exp", "hyper_connection.low_rank", 4, "tensor 'blk.0.hc_attn_down.weight' has shape [8, 1024], the "
     "metadata expects [4, 1024]"),
    ("qwen4exp", "ssm.time_step_rank", 4, "tensor 'blk.0.ssm_beta.weight' has shape [6, 256], the metadata expects "
     "[4, 256]"),  # q/k/v and gate widths still agree (2*2*32 + 4*48 = 320): the beta projection does not
    ("qwen4exp", "attention.indexer.head_count", 2, "tensor 'blk.3.indexer.q_proj.weight' has shape [128, 256], "
     "the metadata expects [64, 256] (from qwen4exp.attention.indexer.head_count=2, "
     "qwen4exp.attention.indexer.key_length=32"),
    ("qwen4exp", "ple.conv_kernel", 3, "tensor 'blk.1.ple_conv1d.weight' has shape [1024, 4], the metadata expects "
     "[1024, 3]"),
    ("qwen3", "attention.key_length", 16, "tensor 'blk.0.attn_q.weight' has shape [128, 64], the metadata expects "
     "[64, 64]"),
    ("qwen3moe", "expert_count", 8, "tensor 'blk.0.ffn_gate_inp.weight' has shape [16, 64], the metadata expects "
     "[8, 64]"),
    ("qwen3moe", "expert_feed_forward_length", 16, "tensor 'blk.0.ffn_gate_exps.weight' has shape [16, 32, 64], "
     "the metadata expects [16, 16, 64]"),
    # without key_length the head width is embedding_length / head_count: 32 / 4 = 8
    ("llama", "attention.head_count", 4, "tensor 'blk.0.attn_k.weight' has shape [16, 32], the metadata expects "
     "[8, 32] (from llama.attention.head_count_kv=1, llama.embedding_length=32, llama.attention.head_count=4)"),
    ("qwen2", "feed_forward_length", 48, "tensor 'blk.0.ffn_gate.weight' has shape [64, 32], the metadata expects "
     "[48, 32] (from qwen2.feed_forward_length=48, qwen2.embedding_length=32)"),
    ("gemma3", "attention.key_length", 8, "tensor 'blk.0.attn_q.weight' has shape [32, 32], the metadata expects "
     "[16, 32]"),
]


@pytest.mark.parametrize("family,key,value,needle", SHAPE_CASES, ids=[f"{c[0]}:{c[1]}={c[2]}" for c in SHAPE_CASES])
def test_metadata_that_disagrees_with_the_tensors(tmp_path, family, key, value, needle):
    src = _fixture(family) or E.tiny_dense(tmp_path / f"{family}.gguf", family)
    p = _edited(tmp_path, E.layout(src), f"{family}.{key}", value)
    msg = _refusal(p)
    assert msg.startswith(f"{p}: {needle}"), msg


def _swap_dims(tmp_path, src, name):
    """``src`` with tensor ``name``'s two dims swapped (same byte count: the reader accepts it)."""
    lay = E.layout(src)
    d0, d1 = E.part(lay, f"tensor:{name}:dim0"), E.part(lay, f"tensor:{name}:dim1")
    data = E.set_field(E.set_field(lay.data, d0, E.get_field(lay.data, d1)), d1, E.get_field(lay.data, d0))
    p = tmp_path / "bad_mtp.gguf"
    p.write_bytes(data)
    return p


MTP_CASES = [
    # (fixture, appended by add_mtp_block, tensor whose dims are swapped, message)
    ("qwen35_f32", False, "blk.4.nextn.eh_proj.weight", "tensor 'blk.4.nextn.eh_proj.weight' has shape [128, 64], "
     "the metadata expects [64, 128] (from qwen35.embedding_length=64)"),
    ("qwen35moe_q8_0", True, "blk.4.nextn.eh_proj.weight", "tensor 'blk.4.nextn.eh_proj.weight' has shape "
     "[512, 256], the metadata expects [256, 512]"),
    ("qwen3next_q8_0", True, "blk.4.attn_v.weight", "tensor 'blk.4.attn_v.weight' has shape [256, 128], the "
     "metadata expects [128, 256]"),
    ("qwen4exp_q8_0", True, "blk.4.hc_ffn_up.weight", "tensor 'blk.4.hc_ffn_up.weight' has shape [8, 1024], the "
     "metadata expects [1024, 8] (from qwen4exp.hyper_connection.count=4, qwen4exp.embedding_length=256, "
     "qwen4exp.hyper_connection.low_rank=8)"),
]


@pytest.mark.parametrize("fixture,append,tensor,needle", MTP_CASES, ids=[c[0] for c in MTP_CASES])
def test_mtp_block_that_disagrees_with_the_metadata(tmp_path, fixture, append, tensor, needle):
    from strata_jax.testing.mtp_block import add_mtp_block

    src = FIX / f"{fixture}.gguf"
    if append:
        src = add_mtp_block(str(src), str(tmp_path / "mtp.gguf"))
    p = _swap_dims(tmp_path, src, tensor)
    g = open_gguf(p)
    cfg = config_from_gguf(g)
    assert cfg.n_nextn == 1
    check_stages(g, cfg, [(0, cfg.n_layer)])  # the trunk agrees with the metadata
    with pytest.raises(StrataError) as e:
        mtp_head(g, cfg)
    assert str(e.value).startswith(f"{p}: {needle}"), str(e.value)
    with pytest.raises(StrataError) as e:
        Engine(g, max_context=16, weights="blocks").mtp.enable(1)
    assert str(e.value).startswith(f"{p}: {needle}")


def test_missing_tensors(tmp_path):
    """A tensor the metadata implies but the file lacks: a GDN layer's ``ssm_a``, and the indexer of a qwen4exp
    layer whose compress ratio is > 0 (llama.cpp requires it; without it the layer would silently run dense)."""
    for fixture, name in (("qwen3next", "blk.0.ssm_a"), ("qwen4exp", "blk.3.indexer.k_norm.weight")):
        lay = E.layout(FIX / f"{fixture}_q8_0.gguf")
        a, b = lay.tensors[name]
        h = E.header(lay)
        p = tmp_path / f"{fixture}_missing.gguf"
        p.write_bytes(E.rebuild(lay, h[:a] + h[b:], n_tensors=lay.n_tensors - 1))
        g = open_gguf(p)
        with pytest.raises(StrataError) as e:
            Engine(g, max_context=16)
        assert str(e.value) == f"{p}: tensor {name!r} is missing from the GGUF file"


def _retyped(tmp_path, name, qtype: int):
    lay = E.layout()
    p = tmp_path / "retyped.gguf"
    p.write_bytes(E.set_field(lay.data, E.part(lay, f"tensor:{name}:type"), qtype))
    return p


def test_block_format_wrong_for_the_role(tmp_path):
    """A norm stored in a K-quant (256 values: one Q4_K block, which the reader accepts) is refused: norms, biases
    and the other vectors are read as floats (F32, F16, BF16: what llama.cpp's converters write for them)."""
    from gguf import GGMLQuantizationType as Q

    p = _retyped(tmp_path, "blk.0.attn_norm.weight", Q.Q4_K)
    with pytest.raises(StrataError) as e:
        Engine(open_gguf(p), max_context=16)
    assert str(e.value) == f"{p}: tensor 'blk.0.attn_norm.weight' is stored as Q4_K; its role takes only F32, F16, BF16"


def test_refused_before_any_tensor_is_read(tmp_path, monkeypatch):
    """Nothing half-loaded: the engine checks every tensor of every stage (an abstract build) before it reads the
    data of any, so a bad layer 3 of a two-stage split leaves nothing placed."""
    lay = E.layout()
    p = _edited(tmp_path, lay, "qwen3next.attention.head_count", 2)
    reads = []
    real = GGUFFile.tensor_bytes
    monkeypatch.setattr(GGUFFile, "tensor_bytes", lambda self, name: reads.append(name) or real(self, name))
    with pytest.raises(StrataError, match="blk.3.attn_q.weight"):
        Engine(str(p), max_context=16, layer_split="2", devices=jax.devices()[:2])
    assert reads == []
    Engine(str(E.FIXTURE), max_context=16, layer_split="2", devices=jax.devices()[:2], weights="blocks")
    assert sorted(set(reads)) == sorted(lay.tensors)  # the valid file: every tensor read


@pytest.mark.parametrize("geometry", ["qwen3-next-80b-a3b", "qwen3.6-35b-a3b", "qwen3.8-flash-next"])
def test_random_weight_geometries_pass_their_own_shapes(geometry):
    """The random-weight builder's tensor tables agree with the metadata it writes (trunk and MTP block, checked
    abstractly: no weights drawn), and an edited key is refused naming the tensor."""
    from strata_jax.testing.random_weights import VirtualGGUF, load_geometry

    v = VirtualGGUF(load_geometry(geometry), n_layer=4, mtp=True)
    cfg = config_from_gguf(v)
    check_stages(v, cfg, [(0, 2), (2, cfg.n_layer)])
    with dry_run():
        nnx.eval_shape(lambda: mtp_head(v, cfg))
    v.metadata[f"{cfg.arch}.attention.head_count"] = cfg.n_head // 2
    with pytest.raises(StrataError) as e:
        check_stages(v, config_from_gguf(v), [(0, cfg.n_layer)])
    assert str(e.value).startswith(f"<random {cfg.arch} geometry>: tensor 'blk.3.attn_q.weight' has shape ")


def test_cli_refuses_cleanly(tmp_path):
    """End to end: one ``error:`` line naming the tensor, exit 2, no traceback."""
    from test_cli_errors import assert_clean_error, run_cli

    p = _edited(tmp_path, E.layout(), "qwen3next.ssm.conv_kernel", 3)
    assert_clean_error(run_cli("--model", str(p), "--prompt_ids", "1,2"), "tensor 'blk.0.ssm_conv1d.weight'",
                       "the metadata expects [512, 3]", "qwen3next.ssm.conv_kernel=3")
    from gguf import GGMLQuantizationType as Q

    p = _retyped(tmp_path, "blk.0.attn_norm.weight", Q.Q4_K)
    assert_clean_error(run_cli("--model", str(p), "--prompt_ids", "1,2"), "tensor 'blk.0.attn_norm.weight'",
                       "stored as Q4_K")
