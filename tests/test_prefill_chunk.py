"""The prefill chunk size (``Engine(prefill_chunk=...)``, ``--prefill_chunk``) and the prompt progress line.

On the tiny qwen3next hybrid (GDN layers: inside a prefill call the delta rule is solved in 64-row pieces, so a
chunk of 16 or 48 rows is padded there with rows that leave the state unchanged): the prompt's logits read in such
chunks equal HF transformers' float32 logits (the committed fixture ``qwen3next_ref.npz``) as closely as the
default chunk's do in test_hybrid; ``on_chunk`` is called once per chunk with the tokens read so far; bad chunk
sizes are refused in one line before any weights load; and strata-generate's ``reading prompt`` line goes to a
terminal's stderr only, leaving stdout as it is without the line.
"""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import numpy as np
import pytest

from strata_jax.errors import StrataError
from strata_jax.pipeline.engine import PREFILL_CHUNK, Engine
from strata_jax.sampling import SamplingParams

FIX = Path(__file__).parent / "fixtures" / "hybrid"
HYBRID = str(FIX / "qwen3next_f32.gguf")
CTX = 96  # as test_admission: the same shared engine
ROOT = Path(__file__).resolve().parents[1]


def _hybrid(engine_for):
    if not Path(HYBRID).exists():
        pytest.fail("committed hybrid fixture is missing (experiments/parity/make_hybrid_fixtures.py makes it)")
    return engine_for(HYBRID, max_context=CTX)


@pytest.mark.parametrize("chunk", [0, -16, 24, 100, CTX + 16, 2.5, "x"])
def test_bad_chunk_refused_before_loading(chunk, monkeypatch):
    """A chunk that is not a positive multiple of 16 up to max_context: one StrataError line naming the flag,
    raised before the weights load (the loader is never called)."""
    import strata_jax.pipeline.engine as E

    monkeypatch.setattr(E, "make_stage", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(StrataError) as e:
        Engine(HYBRID, max_context=CTX, prefill_chunk=chunk)
    msg = str(e.value)
    assert msg == (f"--prefill_chunk {chunk}: must be a positive multiple of 16 up to --max_context {CTX} (or the "
                   f"default {PREFILL_CHUNK})"), msg


def test_chunk_setter_checks(engine_for, monkeypatch):
    """Setting the chunk checks it; the default stays valid on a context shorter than it (it is padded)."""
    eng = _hybrid(engine_for)
    assert eng.prefill_chunk == PREFILL_CHUNK > CTX
    with pytest.raises(StrataError, match="--prefill_chunk 40"):
        eng.prefill_chunk = 40
    monkeypatch.setattr(eng, "prefill_chunk", 32)
    assert eng.prefill_chunk == 32


@pytest.mark.parametrize("platform,ctx,want", [("gpu", 4096, 512), ("gpu", 512, 512), ("gpu", 496, 128),
                                               ("cpu", 4096, 128)])
def test_default_chunk_by_backend(platform, ctx, want):
    """No chunk chosen: 512 rows on a GPU whose context holds them, else 128 (a CPU; a GPU with a short context)."""
    from types import SimpleNamespace

    from strata_jax.pipeline.engine import default_prefill_chunk

    assert default_prefill_chunk(SimpleNamespace(platform=platform), ctx) == want


@pytest.mark.parametrize("chunk", [16, 48])
def test_chunk_not_a_multiple_of_64_matches_hf(engine_for, monkeypatch, chunk):
    """The 64-token reference prompt read in chunks of 16 (4 calls) or 48 (48 + 16 rows): the logits of every
    prompt row against HF's float32 logits (test_hybrid's bound), and ``on_chunk`` once per chunk, increasing."""
    eng = _hybrid(engine_for)
    monkeypatch.setattr(eng, "prefill_chunk", chunk)
    ref = np.load(FIX / "qwen3next_ref.npz")
    ids = [int(t) for t in ref["prompt_ids"]]
    calls = []
    pick, logits = eng.prefill(0, ids, SamplingParams(0.0), all_logits=True,
                               on_chunk=lambda read, total: calls.append((read, total)))
    want = [(min(len(ids), c), len(ids)) for c in range(chunk, len(ids) + chunk, chunk)]
    assert calls == want, calls
    rel = float(np.max(np.abs(logits - ref["prefill_logits"])) / np.max(np.abs(ref["prefill_logits"])))
    assert rel < 1e-4, (chunk, rel)
    assert pick == int(ref["prefill_logits"][-1].argmax()) == int(ref["step_ids"][0])


class _Tty:
    """A text sink that says it is a terminal (tqdm draws only on one)."""

    def __init__(self):
        self.parts = []

    def write(self, s):
        self.parts.append(s)

    def flush(self):
        pass

    def isatty(self):
        return True


def test_progress_line_only_for_long_prompts(capsys):
    """No callback for a prompt of <= 4 chunks; for a longer one the line starts after the first chunk (the
    compile) and shows the tokens read of the total; nothing reaches stdout."""
    from strata_jax.cli.console import prompt_progress

    assert prompt_progress(64, 16) is None and prompt_progress(4 * 128, 128) is None
    tty = _Tty()
    cb = prompt_progress(80, 16, file=tty)
    cb(16, 80)
    assert "reading prompt" in "".join(tty.parts) and "16/80" in "".join(tty.parts)
    for r in (32, 48, 64, 80):
        cb(r, 80)
    assert capsys.readouterr().out == ""
    piped = _Tty()
    piped.isatty = lambda: False  # a pipe or a file: no line at all
    cb = prompt_progress(80, 16, file=piped)
    for r in range(16, 81, 16):
        cb(r, 80)
    assert piped.parts == []


def _generate(stderr_tty: bool):
    """strata-generate on the hybrid with an 80-token prompt in chunks of 16 (5 chunks): (stdout, stderr), with
    stderr a pseudo-terminal or a pipe."""
    ids = ",".join(str(1 + 37 * i % 500) for i in range(80))
    cmd = [sys.executable, "-m", "strata_jax.cli.generate", "--model", HYBRID, "--prompt_ids", ids,
           "--max_new_tokens", "3", "--max_context", str(CTX), "--prefill_chunk", "16", "--xla_cache_dir", ""]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not stderr_tty:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout, p.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty has 0 columns
    got = []

    def drain():
        while True:
            try:
                b = os.read(master, 4096)
            except OSError:
                return
            if not b:
                return
            got.append(b)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=slave, text=True, env=env, cwd=ROOT, timeout=300)
    os.close(slave)
    t.join(10)
    os.close(master)
    err = b"".join(got).decode("utf-8", "replace")
    assert p.returncode == 0, err
    return p.stdout, err


def test_cli_progress_on_a_terminal_leaves_stdout_alone():
    """The same run with stderr on a terminal (the progress line drawn there) and on a pipe (no line): stdout is
    the same text, with no trace of the line; the terminal got it."""
    out_tty, err_tty = _generate(True)
    out_pipe, err_pipe = _generate(False)
    assert "reading prompt" in err_tty and "/80" in err_tty
    assert "reading prompt" not in err_pipe
    assert out_tty == out_pipe and out_tty.strip() and "reading" not in out_tty and "\r" not in out_tty


def test_cli_refuses_a_bad_chunk_before_loading():
    """--prefill_chunk 24: one error line, exit status 2, before the model loads (no load bar, no compile)."""
    p = subprocess.run([sys.executable, "-m", "strata_jax.cli.generate", "--model", HYBRID, "--prompt_ids", "1,2",
                        "--max_context", "64", "--prefill_chunk", "24"], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "error: --prefill_chunk 24: must be a positive multiple of 16 up to --max_context 64 (or the default 128)"]
