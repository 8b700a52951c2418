"""strata-generate end to end on small decodes: honest stats for a short run, and the batch branch's --chat,
--system and --stats_json."""

import json
import re
import subprocess
import sys

import pytest


def _run(*args):
    return subprocess.run([sys.executable, "-m", "strata_jax.cli.generate", *args], capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_short_run_rate_leaves_out_compiled_windows(model_path, tmp_path):
    """--max_new_tokens 2: the one decode window compiles, so nothing is left to measure (no inflated rate)."""
    st = tmp_path / "stats.json"
    proc = _run("--model", model_path("smollm2-135m"), "--prompt_ids", "1,2,3", "--max_new_tokens", "2",
                "--max_context", "16", "--stats_json", str(st), "--xla_cache_dir", "")
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(st.read_text())
    assert d["generated"] == 2 and d["windows"] == 1 and d["compiled_windows"] == 1
    assert d["decode_tokens_measured"] == 0 and d["decode_tok_s"] is None and d["window_ms"] is None
    assert d["prefill_compiled"] is True
    line = proc.stderr.strip().splitlines()[-1]
    assert "decode rate n/a: its one decode step compiled" in line and "tok/s over" not in line, line


@pytest.mark.slow
def test_batch_chat_system_stats_json(model_path, tmp_path):
    """--chat is the default of lines without "chat" (and --system applies to them); --stats_json gets the batch
    run's statistics; the tokens equal the solo run of the same chat prompt."""
    m = model_path("smollm2-135m")
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"prompt": "What is 2+2?", "id": "chat"}\n{"prompt": "Hi", "chat": false, "id": "plain"}\n')
    st, out = tmp_path / "stats.json", tmp_path / "out.jsonl"
    common = ["--model", m, "--max_new_tokens", "3", "--max_context", "64", "--chat", "--system", "Be brief."]
    proc = _run(*common, "--prompts_file", str(f), "--batch", "2", "--stats_json", str(st), "--out_jsonl", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["plain"]["prompt_tokens"] == 1 and recs["chat"]["prompt_tokens"] > 15  # system + user template
    d = json.loads(st.read_text())
    assert d["requests"] == 2 and d["tokens"] == sum(len(r["tokens"]) for r in recs.values())
    assert {r["id"] for r in d["per_request"]} == {"chat", "plain"} and "tok_s" in d and "rate_rule" in d
    # time to first token: per request (arrival to first token) and its median / max on the batch line
    ttfts = sorted(r["ttft_s"] for r in d["per_request"])
    assert ttfts[0] > 0 and d["ttft_s"]["max"] == ttfts[-1] and ttfts[0] <= d["ttft_s"]["median"] <= ttfts[-1]
    assert all(r["prefill_chunks"] == 1 for r in d["per_request"]) and d["prefill_chunks"] == 2
    assert f"time to first token median {d['ttft_s']['median']:.2f} s" in proc.stderr.strip().splitlines()[-1]
    solo_st = tmp_path / "solo.json"
    solo = _run(*common, "--prompt", "What is 2+2?", "--stats_json", str(solo_st))
    assert solo.returncode == 0, solo.stderr[-2000:]
    ds = json.loads(solo_st.read_text())
    assert ds["prompt_tokens"] == recs["chat"]["prompt_tokens"] and ds["tokens"] == recs["chat"]["tokens"]
    assert ds["text"].strip() == solo.stdout.strip() and ds["sampling"]["temperature"] == 0.0
    assert ds["backend"] == "cpu" and ds["jax"]
    chat_lines = [ln.split("] ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("[chat] ")]
    assert solo.stdout.strip() == " ".join(chat_lines).strip()


@pytest.mark.slow
def test_batch_stop_string_equals_solo(model_path, tmp_path):
    """--stop applies to every request of a --prompts_file and cuts where the solo run cuts (stop reason
    "stop string"; the token that completes the string is kept)."""
    m = model_path("smollm2-135m")
    common = ["--model", m, "--max_new_tokens", "12", "--max_context", "64", "--stop", " the"]
    solo_st = tmp_path / "solo.json"
    solo = _run(*common, "--prompt", "Once upon a time", "--stats_json", str(solo_st))
    assert solo.returncode == 0, solo.stderr[-2000:]
    assert json.loads(solo_st.read_text())["stop_reason"] == "stop string", solo.stdout
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"prompt": "Once upon a time", "id": "a"}\n{"prompt": "Hello", "id": "b"}\n')
    out = tmp_path / "out.jsonl"
    proc = _run(*common, "--prompts_file", str(f), "--batch", "2", "--out_jsonl", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["a"]["stop_reason"] == "stop string"
    assert recs["a"]["text"].strip() == solo.stdout.strip()


@pytest.mark.slow
def test_context_beyond_training_warns():
    """--max_context above the file's <arch>.context_length runs, with a warning line naming both numbers."""
    from pathlib import Path

    fx = str(Path(__file__).parent / "fixtures" / "hybrid" / "qwen3next_q8_0.gguf")  # context_length 4096
    proc = _run("--model", fx, "--prompt_ids", "5,6,7", "--max_new_tokens", "2", "--max_context", "4100",
                "--xla_cache_dir", "")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: --max_context 4100 is beyond the 4096 positions" in proc.stderr


@pytest.mark.slow
def test_batch_rate_leaves_out_arrival_waits(model_path, tmp_path):
    """A request arriving after the first one finished (10 s after the start): the wait is announced on stderr when
    it starts, reported in the summary and left out of tok/s."""
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"prompt_ids": [1, 2, 3], "id": "a"}\n{"prompt_ids": [1, 2, 3], "id": "b", "arrival": 10.0}\n')
    st = tmp_path / "stats.json"
    proc = _run("--model", model_path("smollm2-135m"), "--prompts_file", str(f), "--batch", "2", "--max_new_tokens",
                "2", "--max_context", "16", "--stats_json", str(st), "--xla_cache_dir", "")
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(st.read_text())
    req = {r["id"]: r for r in d["per_request"]}
    gap = req["b"]["arrival_s"] - req["a"]["finished_s"]  # > 0 unless request a took longer than 10 s
    assert abs(d["idle_seconds"] - max(gap, 0.0)) < 0.3, (d["idle_seconds"], gap)
    if gap > 0.1:
        assert "waiting for arrivals" in proc.stderr.strip().splitlines()[-1]
    if gap > 1.5:   # a wait of >= 1 s is announced once, as it starts (not only in the summary)
        notes = [ln for ln in proc.stderr.splitlines() if ln.startswith("waiting ")]
        assert len(notes) == 1 and "for request 'b' to arrive" in notes[0], proc.stderr[-2000:]
        assert abs(float(notes[0].split()[1]) - gap) < 0.5, (notes, gap)


def _reassemble(stdout: str) -> dict:
    """Each request's text from the labelled batch lines: ``[id] line`` starts a line, ``[id]+ piece`` continues
    the request's last line."""
    texts: dict = {}
    for ln in stdout.splitlines():
        m = re.match(r"\[([^\]]+)\](\+?)(?: (.*))?$", ln)
        assert m, ln
        rid, cont, piece = m.group(1), m.group(2), m.group(3) or ""
        texts[rid] = (texts.get(rid, "") + piece) if cont else (texts[rid] + "\n" + piece if rid in texts else piece)
    return texts


@pytest.mark.slow
def test_batch_streams_labelled_lines_and_sizes_the_slots(model_path, tmp_path):
    """--prompts_file streams each request's text as labelled lines as it is generated (the short request, submitted
    second, prints before the long one ends); the lines give back each request's text; --batch 8 with 2 requests
    runs 2 slots and says so."""
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"prompt": "Once upon a time", "id": "long", "max_new_tokens": 14}\n'
                 '{"prompt": "Hello", "id": "short", "max_new_tokens": 2}\n')
    st, out = tmp_path / "stats.json", tmp_path / "out.jsonl"
    proc = _run("--model", model_path("smollm2-135m"), "--prompts_file", str(f), "--batch", "8", "--max_context", "64",
                "--stats_json", str(st), "--out_jsonl", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "batch: 2 requests: 2 slots instead of --batch 8" in proc.stderr
    d = json.loads(st.read_text())
    assert d["batch"] == 2 and d["batch_flag"] == 8
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert proc.stdout.splitlines()[0].startswith("[short]"), proc.stdout
    texts = _reassemble(proc.stdout)
    assert set(texts) == {"long", "short"}
    for rid, r in recs.items():
        assert texts[rid].strip() == r["text"].strip(), (rid, texts[rid], r["text"])
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("[batch: 2 slots, serial | 2 requests") and "XLA cache:" in line, line


@pytest.mark.slow
def test_verbose_log_lines_never_inside_text(model_path):
    """--verbose with stdout and stderr on one stream: every log record starts a line (the decode step's compile
    is logged after the first streamed token), and the text reads the same as without logs. The run is split over
    two CPU devices (the suite's XLA_FLAGS give four): it says its stages and their devices."""
    args = ["--model", model_path("smollm2-135m"), "--prompt", "Once upon a time", "--max_new_tokens", "6",
            "--max_context", "64", "--layer_split", "15"]
    plain = _run(*args)
    assert plain.returncode == 0, plain.stderr[-2000:]
    err = plain.stderr.splitlines()
    assert any(ln.startswith("stage 0 (layers 0..14, ") for ln in err), plain.stderr[-2000:]
    assert any(ln.startswith("stage 1 (layers 15..29, ") for ln in err), plain.stderr[-2000:]
    assert ", 2 stages |" in err[-1], err[-1]
    proc = subprocess.run([sys.executable, "-m", "strata_jax.cli.generate", *args, "--verbose"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:]
    log = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]")
    lines = proc.stdout.splitlines()
    assert any("compiled (0, 'step'" in ln for ln in lines), proc.stdout[-2000:]
    assert all(m.start() == 0 for ln in lines for m in log.finditer(ln)), proc.stdout[-3000:]
    notes = ("[loaded", "compil", "stage ", "hand-off: ")
    text = "".join(ln for ln in lines if not log.match(ln) and not ln.startswith(notes))
    assert text.strip() == plain.stdout.strip(), (text, plain.stdout)


def test_beside_summary_names_steps_left_out():
    """The stats line's "decode beside prompt reads" part: the rate with its sample and the compiled steps left
    out; "n/a" when every such step compiled (a new user could not tell that from no overlap) or when the steps
    took under 50 ms (the JSON's rate is then null too); nothing without overlap."""
    from strata_jax.cli.generate import beside_rate, beside_summary
    st = {"beside_prefill_steps": 29, "beside_prefill_tokens": 29, "beside_prefill_compiled_steps": 1,
          "beside_prefill_seconds": 0.354}
    assert beside_summary(81.84, st) == ("; decode beside prompt reads 81.8 tok/s (29 tok over 29 steps, leaving out "
                                         "1 step that compiled)")
    assert beside_rate(81.84, st) == 81.84
    st = {"beside_prefill_steps": 1, "beside_prefill_tokens": 1, "beside_prefill_compiled_steps": 0,
          "beside_prefill_seconds": 0.294}
    assert beside_summary(3.4, st) == "; decode beside prompt reads 3.4 tok/s (1 tok over 1 step)"
    short = dict(st, beside_prefill_seconds=0.0123)
    assert beside_summary(81.3, short) == ("; decode beside prompt reads n/a (1 tok over 1 step in 12.3 ms: too short "
                                           "to time)")
    assert beside_rate(81.3, short) is None
    st = {"beside_prefill_steps": 0, "beside_prefill_tokens": 0, "beside_prefill_compiled_steps": 2,
          "beside_prefill_seconds": 0.0}
    assert beside_summary(None, st) == ("; decode beside prompt reads n/a (the 2 steps reading a prompt beside "
                                        "decoding slots compiled)")
    assert beside_summary(None, dict(st, beside_prefill_compiled_steps=0)) == ""
