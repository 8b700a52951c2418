"""Bad input to strata-generate: one clear line naming the problem, exit status 2, no traceback, nothing written."""

import os
import subprocess
import sys

import numpy as np
import pytest

from strata_jax.errors import StrataError


def run_cli(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "strata_jax.cli.generate", *args], capture_output=True, text=True,
                          timeout=600, env=e)


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    err = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    line = err[-1]
    assert line.startswith("error: "), line
    for n in needles:
        assert n in line, line


def _tiny_gguf(path, arch="llama", embd_type=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_context_length(64)
    rng = np.random.default_rng(0)
    if embd_type is None:
        w.add_tensor("token_embd.weight", rng.standard_normal((16, 32)).astype(np.float32))
    else:
        # raw bytes of a block format the engine does not read (Q8_1: 40 bytes per 32 values)
        w.add_tensor("token_embd.weight", rng.integers(0, 255, (16, 40), dtype=np.uint8), raw_dtype=embd_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_missing_file(tmp_path):
    assert_clean_error(run_cli("--model", str(tmp_path / "missing.gguf"), "--prompt", "hi"), "no such file")


def test_missing_prompt_files_worded_as_a_missing_model(tmp_path):
    """--prompts_file and --prompt_file name a missing file or a directory in the words --model uses."""
    from strata_jax.cli.requests import read_prompts_file

    for path, want in ((tmp_path / "missing.jsonl", "no such file"), (tmp_path, "is a directory, not a file")):
        with pytest.raises(StrataError) as e:
            read_prompts_file(str(path))
        assert str(e.value) == f"--prompts_file {path}: {want}"
    assert_clean_error(run_cli("--model", NO_MODEL, "--prompt_file", str(tmp_path / "p.txt")),
                       f"--prompt_file {tmp_path / 'p.txt'}: no such file")


def test_not_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is not a model\n" * 10)
    assert_clean_error(run_cli("--model", str(p), "--prompt", "hi"), "not a GGUF file")


@pytest.mark.slow
def test_truncated(model_path, tmp_path):
    p = tmp_path / "cut.gguf"
    with open(model_path("smollm2-135m"), "rb") as f:
        p.write_bytes(f.read(50_000_000))
    assert_clean_error(run_cli("--model", str(p), "--prompt", "hi"), "truncated")


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "bert.gguf"
    _tiny_gguf(p, arch="bert")
    assert_clean_error(run_cli("--model", str(p), "--prompt", "hi"), "unsupported architecture", "bert")


def test_unsupported_block_format(tmp_path):
    from gguf import GGMLQuantizationType as Q

    p = tmp_path / "q81.gguf"
    _tiny_gguf(p, embd_type=Q.Q8_1)
    assert_clean_error(run_cli("--model", str(p), "--prompt_ids", "1,2"), "unsupported block format", "Q8_1")


def test_unknown_model_name(tmp_path):
    proc = run_cli("--model", "llama-9000", "--prompt", "hi", env={"STRATA_JAX_CACHE": str(tmp_path)})
    assert_clean_error(proc, "unknown model", "smollm2-135m")
    assert not any(tmp_path.rglob("*.partial"))


@pytest.mark.slow
def test_prompt_longer_than_context(model_path):
    proc = run_cli("--model", model_path("smollm2-135m"), "--prompt", "word " * 100, "--max_context", "16")
    assert_clean_error(proc, "does not fit in --max_context 16")


@pytest.mark.slow
def test_impossible_flags(model_path):
    proc = run_cli("--model", model_path("smollm2-135m"), "--prompt_ids", "1,2", "--chat")
    assert_clean_error(proc, "--chat")
    proc = run_cli("--model", model_path("smollm2-135m"), "--prompt", "a", "--prompt_ids", "1")
    assert_clean_error(proc, "exactly one of")


# ---- checks that need no model (they fire before anything is loaded) -------------------------------------------------
HYBRID_Q8 = os.path.join(os.path.dirname(__file__), "fixtures", "hybrid", "qwen4exp_q8_0.gguf")
NO_MODEL = os.path.join(os.path.dirname(__file__), "no-such-model.gguf")  # never reached: the checks fire first


def _jsonl(tmp_path, *lines, name="reqs.jsonl"):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return str(p)


@pytest.mark.parametrize("args, needles", [
    (["--prompt", "hi", "extra_arg"], ["unexpected argument 'extra_arg'", "quotes"]),
    (["--prompt", "hi", "--stop", ""], ["--stop ''", "empty"]),
    (["--prompt", "hi", "--spec_min_p", "5"], ["--spec_min_p 5", "[0, 1]"]),
    (["--prompt", "hi", "--seed", str(2 ** 32)], ["--seed 4294967296", "0..4294967295"]),
    (["--prompt", "hi", "--seed", "-1"], ["--seed -1"]),
    (["--prompt", "hi", "--draft", "lookup", "--spec", "20"], ["--spec 20", "2..8"]),
    (["--prompt", "hi", "--batch", "2"], ["--batch 2 needs --prompts_file"]),
    (["--prompt_ids", ","], ["--prompt_ids ','", "no token ids"]),
    (["--prompt_ids", "1,x"], ["--prompt_ids '1,x'", "comma-separated integers"]),
    (["--prompt_ids", "1,,3"], ["--prompt_ids '1,,3'", "an empty item"]),
    (["--prompt_ids", "1,2,"], ["--prompt_ids '1,2,'", "an empty item"]),
    (["--prompt_ids", "1,-3"], ["--prompt_ids", ">= 0"]),
    (["--prompt", "hi", "--draft", "model", "--draft_model", "llama-9000"], ["--draft_model", "unknown model"]),
    (["--prompt", "hi", "--out_jsonl", "x.jsonl"], ["--out_jsonl needs --prompts_file"]),
    (["--prompt", "hi", "--batch_mtp"], ["--batch_mtp needs --prompts_file"]),
    (["--prompt", "hi", "--batch_prefill_chunks", "2"], ["--batch_prefill_chunks needs --prompts_file"]),
    (["--prompts_file", "x.jsonl", "--batch_prefill_chunks", "-1"], ["--batch_prefill_chunks -1"]),
    (["--prompt", "hi", "--batch_read_share", "0.3"], ["--batch_read_share needs --prompts_file"]),
    (["--prompts_file", "x.jsonl", "--batch_read_share", "0"], ["--batch_read_share 0", "(0, 1]"]),
    (["--prompts_file", "x.jsonl", "--batch_read_share", "nan"], ["--batch_read_share nan", "(0, 1]"]),
    (["--prompts_file", "x.jsonl", "--batch", "2", "--batch_prefill_chunks", "0", "--batch_read_share", "0.3"],
     ["--batch_read_share does nothing with --batch_prefill_chunks 0"]),
    (["--prompts_file", "x.jsonl", "--batch", "1", "--batch_read_share", "0.3"],
     ["--batch_read_share does nothing with --batch 1"]),
    (["--prompt", "hi", "--top_k", "5000"], ["--top_k 5000", "0..1024"]),
    (["--prompt", "hi", "--spec", "6"], ["--spec 6 needs --draft"]),
    (["--prompt", "hi", "--temperature", "nan"], ["--temperature nan", "finite"]),
    (["--prompt", "hi", "--max_new_tokens", "abc"], ["--max_new_tokens abc: not an integer"]),
    (["--prompt", "hi", "--max_new_tokens=1.5"], ["--max_new_tokens 1.5: not an integer"]),
    (["--prompt", "hi", "--temperature", "hot"], ["--temperature hot: not a number"]),
    (["--prompt", "hi", "--batch", "0"], ["--batch 0: 0 is not a positive integer"]),
    (["--prompt", "hi", "--decode_steps", "0"], ["--decode_steps 0"]),
    (["--prompt", "hi", "--decode_steps", "65"], ["--decode_steps 65"]),
    (["--prompt", "hi", "--ple_table", "gpu"], ["--ple_table gpu"]),
    (["--prompt", "caf\udce9"], ["--prompt", "not valid Unicode"]),  # the byte 0xE9 alone: not UTF-8
    (["--chat", "--prompt", "hi", "--system", "\udcff"], ["--system", "not valid Unicode"]),
    (["--prompt", "hi", "--stop", "\udcff"], ["--stop", "not valid Unicode"]),
    (["--prompt", "hi", "--stats_json", "/proc/strata-stats.json"], ["--stats_json", "cannot write"]),
    (["--prompts_file", "x.jsonl", "--memory_limit_gib", "nan"], ["--memory_limit_gib nan", "positive"]),
    (["--prompts_file", "x.jsonl", "--memory_limit_gib", "-1"], ["--memory_limit_gib -1", "positive"]),
    (["--prompts_file", "x.jsonl", "--memory_limit_gib", "0"], ["--memory_limit_gib 0", "positive"]),
    (["--prompts_file", "x.jsonl", "--memory_limit_gib", "inf"], ["--memory_limit_gib inf", "positive"]),
    (["--prompts_file", "x.jsonl", "--memory_limit_gib", "1e308"], ["--memory_limit_gib 1e+308", "positive"]),
    (["--prompt", "hi", "--memory_limit_gib", "8"], ["--memory_limit_gib needs --prompts_file"]),
])
def test_flag_errors_before_load(args, needles):
    assert_clean_error(run_cli("--model", NO_MODEL, *args), *needles)


def test_stats_json_is_a_folder(tmp_path):
    assert_clean_error(run_cli("--model", NO_MODEL, "--prompt", "hi", "--stats_json", str(tmp_path)),
                       "--stats_json", "is a folder")


def test_one_file_for_two_outputs(tmp_path):
    f = tmp_path / "out.npz"
    assert_clean_error(run_cli("--model", NO_MODEL, "--prompt", "hi", "--dump_logits", str(f), "--stats_json",
                               str(tmp_path / "." / "out.npz")), "--stats_json", "same file as --dump_logits")
    assert not f.exists()


def test_output_over_an_input_file(model_path, tmp_path):
    """An output flag that names an input file (the prompts file, the prompt file, the model) is one error line
    before anything runs, and the input is left as it was (a new user's --stats_json over --prompts_file had
    replaced the requests with the stats, exit 0)."""
    reqs = _jsonl(tmp_path, '{"prompt_ids": [1, 2, 3], "max_new_tokens": 2}')
    before = open(reqs).read()
    for out in ("--stats_json", "--out_jsonl"):
        assert_clean_error(run_cli("--model", HYBRID_Q8, "--batch", "2", "--prompts_file", reqs, out,
                                   str(tmp_path / "." / "reqs.jsonl")), out, "same file as --prompts_file",
                           "overwrite an input")
        assert open(reqs).read() == before
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    assert_clean_error(run_cli("--model", model_path("smollm2-135m"), "--prompt_file", str(prompt), "--stats_json",
                               str(tmp_path / "p.txt")), "--stats_json", "same file as --prompt_file")
    link = tmp_path / "link.jsonl"
    link.symlink_to(reqs)
    assert_clean_error(run_cli("--model", HYBRID_Q8, "--batch", "2", "--prompts_file", reqs, "--stats_json",
                               str(link)), "--stats_json", "same file as --prompts_file")
    npz = tmp_path / "prompt.npz"   # --dump_logits X writes X.npz: that file is the input, X itself is not
    npz.write_text("hello")
    assert_clean_error(run_cli("--model", model_path("smollm2-135m"), "--prompt_file", str(npz), "--dump_logits",
                               str(tmp_path / "prompt")), "--dump_logits", "same file as --prompt_file")
    assert npz.read_text() == "hello"
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert_clean_error(run_cli("--model", str(model), "--prompt", "hi", "--stats_json", str(model)),
                       "--stats_json", "same file as --model")
    assert model.read_bytes() == b"GGUF" and prompt.read_text() == "hello"


def test_output_probe_leaves_files_as_they_were(tmp_path):
    """The output paths are opened before the run (here the missing model is the error that follows): an existing
    file keeps its bytes, a new path leaves no file, a dangling symlink stays (its target is not created), and
    --dump_logits X writes X.npz (numpy's name), so --stats_json X.npz is the same file."""
    old, new = tmp_path / "old.json", tmp_path / "new.jsonl"
    old.write_text("keep me")
    f = _jsonl(tmp_path, '{"prompt": "a"}')
    proc = run_cli("--model", NO_MODEL, "--prompts_file", f, "--stats_json", str(old), "--out_jsonl", str(new))
    assert_clean_error(proc, "no such file", "no-such-model")
    assert old.read_text() == "keep me" and not new.exists()
    link, target = tmp_path / "link.json", tmp_path / "target.json"
    link.symlink_to(target)
    assert_clean_error(run_cli("--model", NO_MODEL, "--prompt", "hi", "--stats_json", str(link)), "no such file")
    assert link.is_symlink() and not target.exists()
    assert_clean_error(run_cli("--model", NO_MODEL, "--prompt", "hi", "--stats_json", str(tmp_path / "sub" / "s.json")),
                       "--stats_json", "not a writable folder")
    proc = run_cli("--model", NO_MODEL, "--prompt", "hi", "--dump_logits", str(tmp_path / "logits"), "--stats_json",
                   str(tmp_path / "logits.npz"))
    assert_clean_error(proc, "--stats_json", "same file as --dump_logits")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "old.json", "reqs.jsonl"]


def test_write_failures_are_one_error_line_and_leave_no_partial_file(tmp_path, monkeypatch):
    """The writers of --stats_json / --out_jsonl / --dump_logits (after the run): an OSError is the command's error
    line naming the flag; a regular file written in part is removed, a device (/dev/full) is not, nor a file that
    could not be opened; --dump_logits X writes X.npz."""
    import json

    from strata_jax.cli import generate as g
    from strata_jax.cli.requests import write_jsonl
    from strata_jax.errors import StrataError

    p = tmp_path / "stats.json"

    def half(f):
        f.write('{"partial": ')
        raise OSError(28, "No space left on device")

    with pytest.raises(StrataError, match=r"^--stats_json .*stats\.json: cannot write it \(No space left on device\)$"):
        g._write_output("stats_json", str(p), half)
    assert not p.exists()
    if os.path.exists("/dev/full"):
        with pytest.raises(StrataError, match=r"^--out_jsonl /dev/full: cannot write it \(No space left"):
            g._write_output("out_jsonl", "/dev/full", g._write_json({"a": "x" * 100_000}))
        assert os.path.exists("/dev/full")
    p.write_text("old")

    def refused(*a, **k):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as m:
        m.setattr(g, "open", refused, raising=False)  # the module's open: the file cannot be opened
        with pytest.raises(StrataError, match=r"cannot write it \(Permission denied\)"):
            g._write_output("stats_json", str(p), g._write_json({"a": 1}))
    assert p.read_text() == "old"
    g._write_output("stats_json", str(p), g._write_json({"a": 1}))
    assert json.loads(p.read_text()) == {"a": 1} and p.read_text().endswith("}\n")
    g._write_output("dump_logits", str(tmp_path / "logits"), lambda f: np.savez(f, a=np.arange(3)), binary=True)
    assert np.load(tmp_path / "logits.npz")["a"].tolist() == [0, 1, 2]
    g._write_output("out_jsonl", str(tmp_path / "out.jsonl"), lambda f: write_jsonl(f, []))
    assert (tmp_path / "out.jsonl").read_text() == ""


def test_out_of_memory_at_load_is_one_error_line():
    """XLA's RESOURCE_EXHAUSTED while the engine loads (here the K/V cache of 10**12 cells on the tiny hybrid
    fixture: 512 TB, more than any address space) is the command's error line with XLA's reason and the flags that
    need less memory, not a traceback. The address space is capped for the run (nothing can really be allocated)."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (32 << 30, 32 << 30))

    proc = subprocess.run([sys.executable, "-m", "strata_jax.cli.generate", "--model", HYBRID_Q8, "--prompt_ids",
                           "1,2", "--max_context", str(10 ** 12), "--xla_cache_dir", ""], capture_output=True,
                          text=True, timeout=600, preexec_fn=cap)
    assert_clean_error(proc, "out of memory while loading the model (Out of memory allocating",
                       "--max_context (now 1000000000000 K/V cells", "--kv_dtype bfloat16")


def test_out_of_memory_error_text():
    """`out_of_memory_error`: XLA's first line after RESOURCE_EXHAUSTED (none: the code alone), the hints of the
    flags as set (no --kv_dtype hint when it is already bfloat16), None for any other error."""
    from absl import flags

    from strata_jax.cli import flags as shared

    F = flags.FLAGS
    if not F.is_parsed():
        F(["test"])
    assert shared.out_of_memory_error(RuntimeError("INTERNAL: something else")) is None
    e = shared.out_of_memory_error(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes.\nmore"))
    assert "\n" not in str(e) and "(Out of memory allocating 8 bytes.)" in str(e), e
    assert "(RESOURCE_EXHAUSTED)" in str(shared.out_of_memory_error(RuntimeError("RESOURCE_EXHAUSTED:  \n")))
    saved = F.kv_dtype
    try:
        F.kv_dtype = "bfloat16"
        assert "--kv_dtype" not in str(shared.out_of_memory_error(RuntimeError("RESOURCE_EXHAUSTED: x")))
    finally:
        F.kv_dtype = saved


def test_prompt_file_not_utf8(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes("caf\xe9".encode("latin-1"))
    assert_clean_error(run_cli("--model", NO_MODEL, "--prompt_file", str(p)), "--prompt_file", "not UTF-8")


def test_help_names_the_module():
    proc = run_cli("--help")
    assert proc.returncode == 0
    assert "strata_jax.cli.generate:" in proc.stdout and "__main__:" not in proc.stdout
    def text(flag):
        return proc.stdout.split(f"\n  --{flag}:")[1].split("\n  --")[0]

    assert "min_p" in text("prompts_file") and "0..7" in text("piped_mtp")
    assert "between two decode windows" in " ".join(text("batch_prefill_chunks").split())


@pytest.mark.parametrize("lines, needles", [
    (['{"prompt": "a", "id": 1}', '{"prompt": "b", "id": 1}'], [":2:", "duplicate id 1", "line 1"]),
    (['{"prompt": "a"}', '{"prompt": "b", "id": 0}'], [":2:", "duplicate id 0"]),  # line 1's default id is 0
    (['{"prompt": "a", "id": "1"}', '{"prompt": "b", "id": 1}'], [":2:", "duplicate id 1", "as text"]),
    (['{"prompt": "a", "id": [1]}'], [":1:", "'id'", "string or a number"]),
    (['{"prompt_ids": [1, -2]}'], [":1:", "'prompt_ids'", ">= 0"]),
    (['{"prompt": "a"}', '{"prompt": "a", "top_k": 5000}'], [":2:", "'top_k' 5000", "0..1024"]),
    (['{"prompt": "a", "temperature": NaN}'], [":1:", "'temperature'", "finite"]),
    (['{"prompt": "a", "arrival": -1}'], [":1:", "'arrival' -1", ">= 0"]),
    (['{"prompt": "a", "arrival": 3000000}'], [":1:", "'arrival' 3000000", "<= 86400", "not milliseconds"]),
    (['{"prompt": "a", "max_new_tokens": 2, "max_new_tokens": 5}'], [":1:", "'max_new_tokens'", "given twice"]),
    (['{"prompt": "a", "seed": 4294967296}'], [":1:", "'seed'", "0..4294967295"]),
    (['{"prompt": "a", "max_new_tokens": 0}'], [":1:", "'max_new_tokens' 0"]),
    (['{"prompt": "a", "tmperature": 1}'], [":1:", "unknown key 'tmperature'"]),
    (['{"prompt": ""}'], [":1:", "'prompt' is empty"]),
    (['{"prompt": "a", "prompt_ids": [1]}'], [":1:", "not both"]),
    (['{"prompt_ids": [1], "chat": true}'], [":1:", "'chat' needs text"]),
    (['[1, 2]'], [":1:", "not a JSON object (got an array"]),
    (['{"prompt": "a",}'], [":1:", "not valid JSON", "column 16"]),
    (['{"prompt": "a", "arrival_offset": 1}'], [":1:", "unknown key 'arrival_offset'"]),
    (['{"prompt": "a", "temperature": 1' + "0" * 400 + '}'], [":1:", "'temperature'", "finite", "chars)"]),
    (['{"prompt": "a", "arrival": 1' + "0" * 400 + '}'], [":1:", "'arrival'", "finite"]),
    (['{"prompt": "a", "id": 1' + "0" * 400 + '}'], [":1:", "'id'", "string or a number"]),
    (['{"prompt": "a\\ud800"}'], [":1:", "'prompt'", "not valid Unicode"]),
    (['{"prompt": "a", "id": "x\\udc00"}'], [":1:", "'id'", "not valid Unicode"]),  # ids label stdout lines
    (['{"prompt": "a", "max_new_tokens": -1' + "0" * 400 + '}'], [":1:", "'max_new_tokens'", "chars)"]),
    (['{"prompt": "a", "top_k": 1' + "0" * 400 + '}'], [":1:", "'top_k'", "0..1024", "chars)"]),
    (['{"prompt_ids": [1, -1' + "0" * 400 + ']}'], [":1:", "'prompt_ids'", ">= 0", "chars)"]),
    (['{"prompt": "a", "seed": 1' + "0" * 5000 + '}'], [":1:", "more than 4300 digits"]),  # json.loads: ValueError
])
def test_prompts_file_line_errors(tmp_path, lines, needles):
    f = _jsonl(tmp_path, *lines)
    assert_clean_error(run_cli("--model", NO_MODEL, "--prompts_file", f), f, *needles)


def test_prompts_file_not_utf8(tmp_path):
    p = tmp_path / "reqs.jsonl"
    p.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert_clean_error(run_cli("--model", NO_MODEL, "--prompts_file", str(p)), "--prompts_file", "not UTF-8")


@pytest.mark.parametrize("args, needles", [
    (["--prompt", "hi"], ["--prompts_file", "cannot be combined with --prompt"]),
    (["--dump_logits", "x.npz"], ["--dump_logits", "--prompts_file"]),
    (["--spec", "4"], ["--spec", "--piped_mtp"]),
])
def test_prompts_file_refused_combinations(tmp_path, args, needles):
    f = _jsonl(tmp_path, '{"prompt": "a"}')
    assert_clean_error(run_cli("--model", NO_MODEL, "--prompts_file", f, *args), *needles)


# ---- checks that need the model's header or tokenizer (before any decoding) -----------------------------------------
def test_unusable_tokenizer_prompt():
    """qwen4exp_q8_0.gguf's tokenizer cannot be built (BPE with tokens missing): --prompt says so, no traceback."""
    assert_clean_error(run_cli("--model", HYBRID_Q8, "--prompt", "hi", "--max_context", "16"),
                       "--prompt needs the model's tokenizer", "no usable one", "--prompt_ids")


def test_unusable_tokenizer_before_the_weights_load(tmp_path):
    """The tokenizer is checked from the header before any weights load (a 50 GB file takes minutes to load): on a
    copy of qwen4exp_q8_0.gguf's header alone (no tensor data) a text prompt, --stop and a text request fail on the
    tokenizer, not on the missing data; --prompt_ids needs no tokenizer and reaches the load (truncated)."""
    from strata_jax.testing.random_gguf import write_header

    head = tmp_path / "head.gguf"
    write_header(HYBRID_Q8, str(head))
    m = ("--model", str(head), "--max_context", "16")
    assert_clean_error(run_cli(*m, "--prompt", "hi"), "--prompt needs the model's tokenizer", "--prompt_ids")
    assert_clean_error(run_cli(*m, "--prompt_ids", "1,2", "--stop", "x"), "--stop needs the model's tokenizer")
    f = _jsonl(tmp_path, '{"prompt_ids": [1, 2]}', '{"prompt": "a", "id": "t"}')
    assert_clean_error(run_cli(*m, "--prompts_file", f), f"--prompts_file {f}:2: request 't'", "give 'prompt_ids'")
    assert_clean_error(run_cli(*m, "--prompt_ids", "1,2"), "truncated")


@pytest.mark.slow
def test_prompts_file_needs_model_checks(model_path, tmp_path):
    m = model_path("smollm2-135m")
    f = _jsonl(tmp_path, '{"prompt_ids": [1, 99999], "id": "big"}')
    assert_clean_error(run_cli("--model", m, "--prompts_file", f), f + ":1", "'big'", "0..49151")
    out = tmp_path / "out.jsonl"
    f = _jsonl(tmp_path, '{"prompt": "a", "id": "short"}', '{"prompt": "' + "word " * 40 + '", "id": "long"}')
    proc = run_cli("--model", m, "--prompts_file", f, "--batch", "2", "--max_context", "16", "--out_jsonl", str(out))
    assert_clean_error(proc, f + ":2", "'long'", "does not fit in --max_context 16")
    assert not out.exists()


@pytest.mark.parametrize("content", [
    '\ufeff{"prompt": "a"}\n{"prompt": "b"}\n',  # a UTF-8 byte-order mark before line 1
    '{"prompt": "line\u2028separator \u0085 inside"}\r\n{"prompt": "b"}\r\n',  # legal in JSON strings; CRLF ends
    '{"prompt": "a", "chat": true}\n',  # --system without --chat: applies to the lines with "chat": true
    '{"prompt": "a", "arrival": 86400}\n',  # the largest arrival (a day)
], ids=["bom", "unicode-line-separators", "system-with-chat-lines", "arrival-a-day"])
def test_prompts_file_valid_inputs_pass_the_checks(tmp_path, content):
    """Valid files pass the file checks: the first error is the (missing) model, not the file."""
    p = tmp_path / "reqs.jsonl"
    p.write_bytes(content.encode("utf-8"))
    assert_clean_error(run_cli("--model", NO_MODEL, "--prompts_file", str(p), "--system", "Be brief."),
                       "no such file", "no-such-model")


def test_xla_cache_dir_unusable(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    assert_clean_error(run_cli("--model", NO_MODEL, "--prompt", "hi", "--xla_cache_dir", str(f / "sub")),
                       "--xla_cache_dir", "compilation cache")


def test_xla_cache_under_an_unusable_cache_dir_names_cache_dir(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    proc = run_cli("--model", NO_MODEL, "--prompt", "hi", "--cache_dir", str(f))
    assert_clean_error(proc, f"--cache_dir {f}: cannot use {f / 'xla'}", "compilation cache", "--xla_cache_dir ''")


def test_verbose_adds_the_traceback_and_still_exits_2(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is not a model\n" * 10)
    proc = run_cli("--model", str(p), "--prompt", "hi", "--verbose")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    err = proc.stderr.strip().splitlines()
    assert "Traceback (most recent call last):" in proc.stderr and "StrataError" in proc.stderr, proc.stderr
    assert err[-1].startswith("error: ") and "not a GGUF file" in err[-1], err[-1]


def test_sampling_flags_with_greedy_warn():
    """--top_k / --seed with greedy decoding (the default --temperature 0) get one warning line naming them, before
    the model is opened (here a missing file then fails); with --temperature > 0, or without them, no warning."""
    proc = run_cli("--model", "nowhere.gguf", "--prompt_ids", "1,2", "--top_k", "5", "--seed", "3")
    assert_clean_error(proc, "nowhere.gguf")
    assert "warning: --top_k, --seed have no effect with greedy decoding (--temperature 0)" in proc.stderr
    proc = run_cli("--model", "nowhere.gguf", "--prompt_ids", "1,2", "--top_k", "-1")  # a bad value: its error only
    assert_clean_error(proc, "--top_k -1")
    assert "warning" not in proc.stderr, proc.stderr
    for extra in (("--top_k", "5", "--temperature", "0.7"), ()):
        proc = run_cli("--model", "nowhere.gguf", "--prompt_ids", "1,2", *extra)
        assert_clean_error(proc, "nowhere.gguf")
        assert "warning" not in proc.stderr, proc.stderr


def test_help_does_not_import_jax():
    """The CLI modules define their flags without importing JAX (`strata_jax.limits` holds the numbers the flags
    need), so `--help` and flag errors answer at once; --help still documents the engine flags."""
    code = ("import sys, strata_jax.cli.generate, strata_jax.cli.serve; "
            "print(sorted(m for m in ('jax', 'flax', 'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "'jax'" not in proc.stdout and "'flax'" not in proc.stdout, proc.stdout
    proc = run_cli("--help")
    assert proc.returncode == 0 and "--prefill_chunk" in proc.stdout and "multiple of 16" in proc.stdout


@pytest.mark.parametrize("ending, code, word", [("interrupt", 130, "interrupted"), ("error", 2, "error: bad"),
                                                 ("done", 0, None)])
def test_command_does_not_wait_for_a_compile_ahead(tmp_path, ending, code, word):
    """A command that ends (Ctrl-C, an error, or normally) while `CompileCache.ahead` still compiles leaves at once
    with its status (the compile serves nothing any more; a cold Flash-Next decode program takes about a minute),
    its streamed text flushed; here the background trace sleeps 60 s."""
    import textwrap
    import time

    script = tmp_path / "ahead_command.py"   # not cmd.py: that shadows the standard library's cmd
    script.write_text(textwrap.dedent(f"""
        import sys, time
        import jax
        from strata_jax.cli import flags as shared
        from strata_jax.errors import StrataError
        from strata_jax.pipeline.windows import CompileCache

        def build():
            def f(x):
                time.sleep(60)   # at trace time: the background thread is busy for a minute
                return x
            return jax.jit(f)

        def main(argv):
            CompileCache().ahead("k", build, (jax.numpy.ones(3),))
            print("streamed text", end="")
            ending = {ending!r}
            if ending == "interrupt":
                raise KeyboardInterrupt
            if ending == "error":
                raise StrataError("bad")
            return 0

        shared.run_command(main, "__main__", "test")
    """))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert time.perf_counter() - t0 < 40, "waited for the background compile"
    assert proc.returncode == code and proc.stdout == "streamed text", (proc.returncode, proc.stdout, proc.stderr)
    if word:
        assert proc.stderr.strip().splitlines()[-1].startswith(word), proc.stderr
    assert "Fatal Python error" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr, proc.stderr


def test_bad_compile_ahead_value_before_the_model_loads(tmp_path):
    """STRATA_COMPILE_AHEAD other than 0 / 1 is one error line, before anything loads (a missing model is not
    reached), whatever --decode_steps."""
    proc = run_cli("--model", str(tmp_path / "absent.gguf"), "--prompt", "hi", env={"STRATA_COMPILE_AHEAD": "yes"})
    assert_clean_error(proc, "STRATA_COMPILE_AHEAD='yes'", "'0', '1'")
