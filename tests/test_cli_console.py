"""What the commands print around the text: notes never inside a line of streamed text, the labelled batch lines,
compile lines for slow compiles, the load progress in bytes, the draft tokenizer check from the headers, and batch
slots sized to the requests. No model is compiled here."""

import time
from pathlib import Path

import pytest

from strata_jax.cli.console import Console, LabelledLines, id_text
from strata_jax.errors import StrataError

HYBRID = Path(__file__).parent / "fixtures" / "hybrid"


def _console(tmp_path, shared: bool):
    out = open(tmp_path / "out.txt", "w+")
    err = out if shared else open(tmp_path / "err.txt", "w+")
    return Console(out=out, err=err), out, err


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()


def test_note_starts_on_its_own_line_when_streams_are_shared(tmp_path):
    con, out, _ = _console(tmp_path, shared=True)
    con.text("The capital")
    con.note("warning: something")
    con.text(" of France")
    con.text("\n")
    con.note("[stats]")
    assert _read(out) == "The capital\nwarning: something\n of France\n[stats]\n"


def test_text_untouched_when_streams_differ(tmp_path):
    con, out, err = _console(tmp_path, shared=False)
    con.text("The capital")
    con.note("warning: something")
    con.text(" of France\n")
    assert _read(out) == "The capital of France\n" and _read(err) == "warning: something\n"


def test_compile_line_completed_or_kept_out_of_text(tmp_path):
    from strata_jax.pipeline.windows import XlaCacheStats

    con, out, _ = _console(tmp_path, shared=True)
    xla = XlaCacheStats(str(tmp_path))
    notify = con.compile_notifier(n_stages=2, xla=xla)
    notify((0, "prefill", 1, 128, "last", 1), None)
    xla._on_event("/jax/compilation_cache/cache_hits")  # one program read, one compiled: not "read"
    xla._on_event("/jax/compilation_cache/cache_misses")
    notify((0, "prefill", 1, 128, "last", 1), 3.21)
    con.text("Paris")
    notify((1, "step", 1, 1, "all", 1), None)  # a line of text is open on the same stream: not shown
    notify((1, "step", 1, 1, "all", 1), 1.5)
    con.text(".\n")
    notify((0, "window", 1, 4, "all", 1), None)
    con.note("interrupting note")
    xla._on_event("/jax/compilation_cache/cache_hits")  # read back, nothing compiled during this call (2.0 s):
    xla.written_at = time.perf_counter() - 10.0          # the prefill's write came before it
    notify((0, "window", 1, 4, "all", 1), 2.0)
    assert _read(out).splitlines() == [
        "compiling prefill chunk (128 rows), stage 1 of 2 ... 3.2 s", "Paris.",
        "compiling verify window (1 x 4 rows), stage 1 of 2 ...", "interrupting note",
        "compiled verify window (1 x 4 rows), stage 1 of 2 in 2.0 s (read from the XLA cache)"]


def test_describe_key_words_every_key_kind():
    """The keys as `Engine.run_stage` / `commit_stage` / `reset_slot` and the MTP chain build them (the shapes the
    shared engine's cache holds are checked in tests/test_server.py)."""
    from strata_jax.pipeline.windows import describe_key

    cases = {
        (0, "prefill", 1, 128, "last", 1): "prefill chunk (128 rows)",
        (0, "prefill", 1, 128, "all", 4): "prefill chunk (128 rows, all logits)",
        (0, "step", 1, 1, "all", 4): "decode step (1 of 4 slots)",
        (0, "step", 4, 1, "all", 4): "decode step (4 slots)",
        (0, "step", 1, 1, "all", 1): "decode step (1 slot)",
        (0, "window", 1, 4, "all", 1): "verify window (1 x 4 rows)",
        (0, "window", 2, 5, "all", 2): "verify window (2 x 5 rows, 2 slots)",
        (0, "commit", ((1, 4, 64),), 2): "window commit (2 slots)",
        (0, "reset", 1): "slot reset (1 slot)",
        ("mtp", "window", 1, 4, 3, 1): "MTP draft chain (3 drafts, 1 x 4 rows)",
        ("mtp", "prefill", 1, 128, 1, 2): "MTP draft chain (1 draft, 1 x 128 rows, prompt)",
    }
    for key, words in cases.items():
        assert describe_key(key) == words, key
    assert describe_key((1, "step", 2, 1, "all", 2), n_stages=3) == "decode step (2 slots), stage 2 of 3"
    assert describe_key(("something", "else")) == "('something', 'else')"


def test_labelled_lines_format(tmp_path):
    con, out, _ = _console(tmp_path, shared=False)
    lines = LabelledLines(con, width=20)
    lines.feed("a", "first line\nsec")
    lines.feed(7, "x")
    lines.feed("a", "ond\n")
    lines.feed(7, "y" * 30)                          # no space: cut at the width
    lines.feed("b", "words that run past the width")  # cut after a space
    lines.finish(7)
    lines.finish("b", " end")
    lines.finish("empty")
    lines.finish("a")                                # its text ended with a newline: nothing left
    assert _read(out).splitlines() == [
        "[a] first line", "[a] second", "[7] " + "x" + "y" * 19, "[b] words that run past ", "[7]+ " + "y" * 11,
        "[b]+ the width end", "[empty]"]


def test_id_text_separates_ids_without_a_trailing_space():
    """Token ids (a model without a usable tokenizer) read ``151 0 42``: single spaces between, none after; two
    renderers (two batch requests) keep their own state."""
    a, b = id_text(), id_text()
    assert "".join(a(t) for t in (151, 0)) + a(42) == "151 0 42"
    assert b(9) == "9" and b(10) == " 10"


def test_compile_cache_announces_slow_first_calls():
    from strata_jax.pipeline.windows import CompileCache

    seen = []
    cache = CompileCache(4, notify=lambda key, s: seen.append((key, s)), notice_after=0.05)

    def slow(x):
        time.sleep(0.4)
        return x

    assert cache.get(("slow",), lambda: slow)(3) == 3
    assert cache.get(("fast",), lambda: (lambda x: x))(4) == 4
    assert cache.get(("slow",), lambda: slow)(5) == 5  # compiled: no first call any more
    assert [k for k, _ in seen] == [("slow",), ("slow",)] and seen[0][1] is None and seen[1][1] >= 0.4
    assert cache.compiles == 2


def test_compile_cache_clear_rebuilds():
    """`CompileCache.clear`: the next get of a key builds again; a first call fetched before the clear and run after
    it does not put its stale function back."""
    from strata_jax.pipeline.windows import CompileCache

    builds = []

    def build(tag):
        builds.append(tag)
        return lambda x: (tag, x)

    cache = CompileCache(4)
    assert cache.get("k", lambda: build("a"))(1) == ("a", 1)
    stale = cache.get("j", lambda: build("b"))        # fetched, not yet called
    cache.clear()
    assert len(cache) == 0 and stale(2) == ("b", 2) and len(cache) == 0
    assert cache.get("k", lambda: build("c"))(3) == ("c", 3) and builds == ["a", "b", "c"]
    assert cache.get("k", lambda: build("d"))(4) == ("c", 4)   # stored after its first call


def test_compile_cache_ahead_compiles_once_for_the_first_call():
    """`CompileCache.ahead`: the function is traced and compiled once, in the background thread, and its first call
    runs that program (the same jitted object: no second trace); the first call waits for the thread; a key built
    or started already is not compiled again; a donated argument abstracted by ahead may be deleted before the
    thread runs."""
    import threading

    import jax
    import numpy as np

    from strata_jax.pipeline.windows import CompileCache

    traces, gate = [], threading.Event()

    def build():
        def f(state, x, n):
            traces.append(threading.current_thread().name)
            gate.wait(5)   # holds the background trace until the main thread has asked for the first call
            return state + x * n, x.sum()
        return jax.jit(f, donate_argnums=(0,))

    state = jax.device_put(jax.numpy.arange(6.0).reshape(2, 3), jax.devices()[0])   # committed, donated below
    x = np.ones((2, 3), np.float32)
    cache = CompileCache(4)
    assert cache.ahead("k", build, (state, x, 2.0)) and not cache.ahead("k", build, (state, x, 2.0))
    assert cache.ahead_started == 1 and cache.ahead_used == 0
    fn = cache.get("k", build)
    assert cache.ahead_used == 1 and cache.compiles == 1   # the first call fetched: one function, built ahead
    threading.Timer(0.2, gate.set).start()
    out, s = fn(state, x, 2.0)
    assert np.allclose(out, np.arange(6.0).reshape(2, 3) + 2.0) and float(s) == 6.0
    assert len(traces) == 1 and traces[0].startswith("strata-compile-ahead"), traces   # traced once, in the thread
    out2, _ = cache.get("k", build)(out, x, 2.0)
    assert np.allclose(out2, np.arange(6.0).reshape(2, 3) + 4.0) and len(traces) == 1
    assert not cache.ahead("k", build, (out2, x, 2.0)) and cache.ahead_started == 1   # built
    assert cache.ahead_used == 1 and cache.compiles == 1
    cache.get("other", build)   # a function not compiled ahead
    assert cache.ahead_used == 1 and cache.compiles == 2


def test_load_progress_counts_every_trunk_tensor():
    """While loading, the stages report the bytes of every tensor once (the load bar's total: all tensors but an
    MTP layer's, which this file has not)."""
    from strata_jax.layers.linear import load_progress
    from strata_jax.pipeline.engine import Engine

    got = []
    with load_progress(got.append):
        eng = Engine(str(HYBRID / "qwen3next_q8_0.gguf"), max_context=16, weights="blocks")
    assert not any(k.startswith(f"blk.{eng.cfg.n_layer}.") for k in eng.gguf.tensors)  # no MTP layer here
    assert sum(got) == sum(t.nbytes for t in eng.gguf.tensors.values()) and len(got) == len(eng.gguf.tensors)


@pytest.mark.slow
def test_draft_tokenizer_checked_from_headers(model_path):
    from strata_jax.cli.flags import check_draft_tokenizer

    smol = model_path("smollm2-135m")
    check_draft_tokenizer(smol, smol)
    with pytest.raises(StrataError, match="different tokenizer"):
        check_draft_tokenizer(smol, model_path("gemma3-270m"))


def test_draft_tokenizer_checked_before_weights(tmp_path):
    """A target whose weights cannot load (an unsupported block format) and a draft: the tokenizer check speaks
    first, so nothing was loaded."""
    import subprocess
    import sys

    from gguf import GGMLQuantizationType as Q
    from test_cli_errors import _tiny_gguf  # tests/ is on the path (pytest's rootdir-relative import)

    p = tmp_path / "q81.gguf"
    _tiny_gguf(p, embd_type=Q.Q8_1)
    proc = subprocess.run([sys.executable, "-m", "strata_jax.cli.generate", "--model", str(p), "--prompt_ids", "1",
                           "--draft", "model", "--draft_model", str(HYBRID / "qwen3next_q8_0.gguf")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --draft_model") and "cannot compare tokenizers" in line, line
    assert "block format" not in proc.stderr


@pytest.mark.parametrize("batch, n_req, groups, stages, want", [
    (64, 2, "auto", 1, 2), (4, 4, "auto", 1, 4), (4, 9, "auto", 1, 4), (8, 3, "4", 2, 4), (8, 1, "auto", 2, 2),
    (6, 1, "auto", 1, 2)])
def test_slots_sized_to_the_requests(batch, n_req, groups, stages, want):
    from absl import flags

    from strata_jax.cli import flags as shared

    F = flags.FLAGS
    if not F.is_parsed():
        F(["test"])
    saved = (F.batch, F.batch_groups, F["batch_groups"].present)
    try:
        F.batch, F.batch_groups = batch, groups
        F["batch_groups"].present = int(groups != "auto")
        n, note = shared.slots_for(n_req, stages)
        assert n == want and (("instead of --batch" in note) == (want < batch)), (n, note)
    finally:
        F.batch, F.batch_groups, F["batch_groups"].present = saved


def test_solo_decode_rate_needs_the_minimum_time():
    """The solo stats line and --stats_json give a decode rate only over >= solo.RATE_MIN_S of measured decoding
    (3 tokens in 10 ms is a figure, not a rate); from that time on the rate is tokens / seconds."""
    from types import SimpleNamespace

    from strata_jax.cli.generate import solo_stats_line
    from strata_jax.pipeline.solo import RATE_MIN_S, GenerationStats

    eng = SimpleNamespace(load_seconds=1.0, weights="f32", stages=[0])
    st = GenerationStats(prompt_tokens=3, prefill_seconds=0.5, generated=4, decode_seconds=0.010, windows=3,
                         stop_reason="max_new_tokens")
    line = solo_stats_line(eng, st, [])
    assert "decode rate n/a: 3 tok in 10.0 ms (too short to time)" in line and "tok/s over" not in line, line
    d = st.as_dict()
    assert d["decode_tok_s"] is None and d["decode_seconds_measured"] == 0.010
    st.decode_seconds = 2 * RATE_MIN_S
    line = solo_stats_line(eng, st, [])
    assert f"decode {3 / (2 * RATE_MIN_S):.1f} tok/s over 3 tok in 3 decode steps" in line, line
    assert st.as_dict()["decode_tok_s"] == 3 / (2 * RATE_MIN_S)
    # a window that compiled is left out of both the tokens and the time
    st.add_compiled_window(1, 0.5, 2 * RATE_MIN_S - 0.02)
    assert "decode rate n/a: 2 tok in 20.0 ms" in solo_stats_line(eng, st, [])
