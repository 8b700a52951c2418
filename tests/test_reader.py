"""The streaming GGUF header parser against gguf.GGUFReader, its speed on Gemma 3's 262k-token header, and its
errors on bad files: one class of malformed header per test, each built from a valid fixture by tests/gguf_edit.py
(which locates every field with gguf-py's GGUFReader and rebuilds the file around an edited header)."""

import os
import struct
import time
import tracemalloc

import gguf_edit as E
import numpy as np
import pytest

from strata_jax.errors import StrataError
from strata_jax.gguf import open_gguf, reader


@pytest.mark.slow
def test_header_matches_gguf_reader(model_path):
    import gguf

    path = model_path("smollm2-135m")
    ours = open_gguf(path)
    ref = gguf.GGUFReader(path)
    assert ours.architecture == "llama"
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        o = ours.tensors[t.name]
        assert o.qtype == t.tensor_type
        assert o.shape == tuple(int(x) for x in reversed(t.shape.tolist()))
        assert o.offset == int(t.data_offset) and o.nbytes == int(t.n_bytes)
        np.testing.assert_array_equal(ours.tensor_bytes(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    assert ours.metadata["llama.block_count"] == 30
    assert ours.metadata["tokenizer.ggml.tokens"][:3] == [bytes(ref.fields["tokenizer.ggml.tokens"].parts[i]).decode()
                                                         for i in ref.fields["tokenizer.ggml.tokens"].data[:3]]


@pytest.mark.slow
def test_gemma3_header_under_two_seconds(model_path):
    path = model_path("gemma3-270m")
    t0 = time.perf_counter()
    g = open_gguf(path)
    dt = time.perf_counter() - t0
    assert len(g.metadata["tokenizer.ggml.tokens"]) == 262144
    assert dt < 2.0, f"header took {dt:.2f} s"


def test_missing_file(tmp_path):
    with pytest.raises(StrataError, match="no such file"):
        open_gguf(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + os.urandom(100))
    with pytest.raises(StrataError, match="not a GGUF file"):
        open_gguf(p)


@pytest.mark.slow
def test_truncated(model_path, tmp_path):
    src = model_path("smollm2-135m")
    for cut in (1000, os.path.getsize(src) - 4096):
        p = tmp_path / f"t{cut}.gguf"
        with open(src, "rb") as f:
            p.write_bytes(f.read(cut))
        with pytest.raises(StrataError, match="truncated"):
            open_gguf(p)


# ---------------------------------------------------------------- malformed headers


def _open(tmp_path, data: bytes, name="bad.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return open_gguf(p)


def _refused(tmp_path, data: bytes, *needles):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(StrataError) as e:
        open_gguf(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}: "), msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_fixture_layout_reads_back(tmp_path):
    """The edit helper's rebuild of the unedited header is the fixture itself, and our reader agrees with gguf-py
    on where every tensor's data is."""
    import gguf

    lay = E.layout()
    assert E.rebuild(lay, E.header(lay)) == lay.data
    g = _open(tmp_path, lay.data)
    ref = {t.name: t for t in gguf.GGUFReader(str(E.FIXTURE)).tensors}
    assert g.data_offset == lay.data_offset and g.alignment == 32 and set(g.tensors) == set(ref)
    for name, t in g.tensors.items():
        assert (t.offset, t.nbytes) == (int(ref[name].data_offset), int(ref[name].n_bytes))


@pytest.mark.parametrize("vtype,value", [
    (E.I32, -2**31), (E.I32, -32), (E.U32, 0), (E.U32, 48), (E.U64, 3), (E.F32, float("nan")),
    (E.F64, float("inf")), (E.F32, 32.0), (E.BOOL, True), (E.STR, "32"), (E.ARR, (E.U32, [32])),
])
def test_bad_alignment(tmp_path, vtype, value):
    lay = E.layout()
    _refused(tmp_path, E.add_kv(lay, E.kv("general.alignment", vtype, value)),
             "key 'general.alignment' must be a positive power of two of an integer type")


@pytest.mark.parametrize("align", [16, 32])
def test_other_alignment_reads_the_same_tensors(tmp_path, align):
    """A valid non-default alignment (the fixture's offsets are multiples of 32, so also of 16): same tensor bytes."""
    lay = E.layout()
    ref = _open(tmp_path, lay.data, "ref.gguf")
    g = _open(tmp_path, E.add_kv(lay, E.kv("general.alignment", E.U32, align), align=align))
    assert g.alignment == align
    for name in ref.tensors:
        assert g.info(name).shape == ref.info(name).shape
        np.testing.assert_array_equal(g.tensor_bytes(name), ref.tensor_bytes(name))


def test_alignment_larger_than_the_offsets_allow(tmp_path):
    lay = E.layout()
    _refused(tmp_path, E.add_kv(lay, E.kv("general.alignment", E.U32, 1024), align=1024),
             "is not on the 1024-byte alignment")


def test_tensor_dims(tmp_path):
    lay = E.layout()
    d0, d1 = E.part(lay, "tensor:output.weight:dim0"), E.part(lay, "tensor:output.weight:dim1")
    _refused(tmp_path, E.set_field(lay.data, d1, 0), "tensor 'output.weight'", "every dim must be >= 1")
    # one byte 0x00 -> 0xFF: the element count overflows int64 (it passed before and crashed at load)
    data = bytearray(lay.data)
    data[d1.end - 1] = 0xFF
    _refused(tmp_path, bytes(data), "tensor 'output.weight'", "beyond the end of the file")
    _refused(tmp_path, E.set_field(E.set_field(lay.data, d0, 2**40), d1, 2**40), "beyond the end of the file")
    _refused(tmp_path, E.set_field(lay.data, d0, 2**64 - 32), "beyond the end of the file")
    _refused(tmp_path, E.set_field(lay.data, d0, 100), "row of 100 is no multiple of the Q8_0 block (32)")
    _refused(tmp_path, E.set_field(lay.data, E.part(lay, "tensor:output.weight:n_dims"), 5), "5 dims (at most 4)")
    _refused(tmp_path, E.set_field(lay.data, E.part(lay, "tensor:output.weight:type"), 1000),
             "unknown block format id 1000")


def test_tensor_offsets(tmp_path):
    lay = E.layout()
    names = list(lay.tensors)
    off = E.part(lay, f"tensor:{names[1]}:offset")
    _refused(tmp_path, E.set_field(lay.data, off, 0), "overlap", repr(names[0]), repr(names[1]))
    _refused(tmp_path, E.set_field(lay.data, off, E.get_field(lay.data, off) + 4), "not on the 32-byte alignment")
    _refused(tmp_path, E.set_field(lay.data, off, len(lay.data)), "beyond the end of the file")
    _refused(tmp_path, E.set_field(lay.data, off, 2**64 - 32), "beyond the end of the file")


def test_duplicates_and_empty_names(tmp_path):
    lay = E.layout()
    a, b = lay.kv["general.name"]
    _refused(tmp_path, E.add_kv(lay, lay.data[a:b]), "duplicate metadata key 'general.name'")
    _refused(tmp_path, E.add_kv(lay, E.kv("", E.U32, 1)), "empty metadata key")
    a, b = lay.tensors["output.weight"]
    h = E.header(lay)
    _refused(tmp_path, E.rebuild(lay, h + h[a:b], n_tensors=lay.n_tensors + 1), "duplicate tensor name 'output.weight'")
    name_len = E.part(lay, "tensor:output.weight:name_len")
    _refused(tmp_path, E.rebuild(lay, h[:name_len.start] + E.string(b"out\xffput.weight") + h[name_len.end + 13:]),
             "tensor name is not UTF-8")


def test_phantom_tensor(tmp_path):
    """A tensor count one too high: the extra tensor info is read from the padding (zeros: an empty name) or from
    the tensor data (here a name length beyond the file); both are refused."""
    lay = E.layout()
    h = E.header(lay)
    _refused(tmp_path, E.rebuild(lay, h, n_tensors=lay.n_tensors + 1), "tensor info 73", "truncated GGUF header")
    a, b = lay.kv["general.size_label"]  # drop a key so that the header ends before the alignment: zero padding
    assert (lay.header_end - (b - a)) % 32
    _refused(tmp_path, E.rebuild(lay, h[:a] + h[b:], n_tensors=lay.n_tensors + 1, n_kv=lay.n_kv - 1),
             "empty tensor name", "tensor info 73")


def test_absurd_counts(tmp_path):
    lay = E.layout()
    for field, v in (("n_tensors", 2**63), ("n_kv", 2**64 - 1), ("n_kv", 200_000), ("n_tensors", 300_000)):
        _refused(tmp_path, E.set_field(lay.data, E.part(lay, field), v), "corrupt GGUF header")
    _refused(tmp_path, E.set_field(lay.data, E.part(lay, "kv:tokenizer.ggml.tokens:count"), 2**61),
             "truncated GGUF header", "metadata key 'tokenizer.ggml.tokens'")
    _refused(tmp_path, E.set_field(lay.data, E.part(lay, "kv:general.name:str_len"), 2**64 - 1),
             "truncated GGUF header", "metadata key 'general.name'")
    _refused(tmp_path, E.set_field(lay.data, E.part(lay, "kv:general.name:vtype"), 13), "unknown GGUF value type 13")


def test_cut_file_says_truncated(tmp_path):
    """A file cut inside its header (plausible counts, too few bytes) is called truncated, not corrupt."""
    lay = E.layout()
    _refused(tmp_path, lay.data[:100], "truncated GGUF file", "100 bytes")


def test_nested_arrays(tmp_path):
    """Arrays of arrays: read up to MAX_ARRAY_DEPTH levels; 500 levels (a 6 KB key, a RecursionError before) and
    more sub-arrays than MAX_SUBARRAYS (100k empty ones: 4M of them cost 1.2 GB before) are refused with little
    memory."""
    lay = E.layout()
    v = (E.I32, [7, 8])
    for _ in range(reader.MAX_ARRAY_DEPTH - 1):
        v = (E.ARR, [v, v])
    g = _open(tmp_path, E.add_kv(lay, E.kv("x.nested", E.ARR, v)))
    x = g.metadata["x.nested"]
    for _ in range(reader.MAX_ARRAY_DEPTH - 1):
        assert isinstance(x, list) and len(x) == 2
        x = x[1]
    np.testing.assert_array_equal(x, [7, 8])
    _refused(tmp_path, E.add_kv(lay, E.kv("x.nested", E.ARR, (E.ARR, [v]))),
             f"nested more than {reader.MAX_ARRAY_DEPTH}")
    for _ in range(500):
        v = (E.ARR, [v])
    _refused(tmp_path, E.add_kv(lay, E.kv("x.deep", E.ARR, v)), "nested more than", "metadata key 'x.deep'")
    n = 100_000
    many = E.string("x.many") + struct.pack("<IIQ", E.ARR, E.ARR, n) + struct.pack("<IQ", E.U32, 0) * n
    data = E.add_kv(lay, many)
    tracemalloc.start()
    try:
        _refused(tmp_path, data, f"more than {reader.MAX_SUBARRAYS} nested arrays")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_array_object_budget(tmp_path, monkeypatch):
    """More strings in metadata arrays than MAX_ARRAY_OBJECTS (lowered here below the fixture's 512 tokens)."""
    monkeypatch.setattr(reader, "MAX_ARRAY_OBJECTS", 100)
    _refused(tmp_path, E.layout().data, "more than 100 strings and sub-arrays", "tokenizer.ggml.tokens")


def test_big_endian(tmp_path):
    import gguf

    p = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(p), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(StrataError, match="big-endian GGUF files are not supported"):
        open_gguf(p)


def test_failed_open_leaves_no_map(tmp_path, monkeypatch):
    """Nothing half-loaded: a refused file's memory map is closed before the error propagates."""
    import mmap

    maps = []

    class Recorded(mmap.mmap):
        def __init__(self, *a, **k):
            maps.append(self)

    monkeypatch.setattr(reader.mmap, "mmap", Recorded)
    lay = E.layout()
    _refused(tmp_path, E.set_field(lay.data, E.part(lay, "tensor:output.weight:dim1"), 0), "every dim")
    assert len(maps) == 1 and maps[0].closed


def test_header_only(tmp_path):
    """A header copy (cut where the tensor data starts) opens with header_only: the same tensor table, no data."""
    lay = E.layout()
    full = _open(tmp_path, lay.data, "full.gguf")
    p = tmp_path / "header.gguf"
    p.write_bytes(lay.data[:lay.data_offset])
    g = open_gguf(p, header_only=True)
    assert {n: (t.shape, t.qtype, t.offset) for n, t in g.tensors.items()} == \
        {n: (t.shape, t.qtype, t.offset) for n, t in full.tensors.items()}
    with pytest.raises(StrataError, match="has no data in this file"):
        g.tensor_bytes("output.weight")
    with pytest.raises(StrataError, match="truncated GGUF file"):
        open_gguf(p)
