"""strata-serve on loopback with the real `openai` client: exact answers under concurrency (greedy and seeded, chat
and completions, streamed and not, against the solo decode and one strata-generate run), stop strings, usage,
a client that disconnects (its slot is freed at the next window boundary), a full queue (429 + Retry-After), an
engine error in one request (that request fails, the others go on), bad requests (400 naming the field), the API
key, /v1/models, /health, /metrics, and SIGTERM draining a real strata-serve process.

The in-process server runs the app with uvicorn in a thread over the session's shared SmolLM2 engine (two slots,
context ``CTX``: the engine of tests/test_spec.py), serial windows beside solo windows with prompt-lookup proposals
(window cap 4), so its compiled functions are reused. The solo references are decoded on the same engine before the
server starts.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the server tests need the 'test' extra (fastapi, uvicorn, openai)")

import httpx  # noqa: E402
import openai  # noqa: E402

from strata_jax.cli import openai_api as oa  # noqa: E402
from strata_jax.cli.requests import chat_messages  # noqa: E402
from strata_jax.limits import SEED_MAX  # noqa: E402
from strata_jax.sampling import SamplingParams  # noqa: E402

CTX = 96
N_NEW = 6
DEFAULT = SamplingParams(0.0)  # the flag defaults (temperature 0, top_k 40, top_p 1, min_p 0, seed 0)


def _seeded(seed):
    return SamplingParams(0.7, 20, 1.0, 0.0, seed)


# (kind, prompt, sampling, stream): greedy and seeded, chat and completions, streamed and not
CASES = [("chat", "What is 2+2?", DEFAULT, False), ("chat", "Name a color.", _seeded(11), True),
         ("completion", "The capital of France is", DEFAULT, True),
         ("completion", "Once upon a time", _seeded(12), False),
         ("chat", "Say hello in French.", _seeded(13), False), ("chat", "Count to three.", DEFAULT, True),
         ("completion", "def add(a, b):", _seeded(14), True), ("chat", "What is the color of the sky?", DEFAULT, False)]
STOP_PROMPT = "Write one sentence about the sea."


def _prompt_ids(tok, kind, text):
    """The prompt as strata-generate reads it (--chat renders one user message with the file's template)."""
    if kind == "chat":
        text = tok.apply_chat_template(chat_messages(text), add_generation_prompt=True)
    return list(tok.encode(text))


@pytest.fixture(scope="module")
def served(engine_for):
    import uvicorn

    from strata_jax.cli.server import Metrics, create_app
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.loop import EngineLoop
    from strata_jax.pipeline.scheduler import BatchScheduler
    from strata_jax.pipeline.solo import generate
    from strata_jax.proposers import LookupProposer

    eng = engine_for("smollm2-135m", max_context=CTX, n_slots=2)
    tok = eng.tokenizer
    refs = []
    for kind, text, samp, _ in CASES:
        ids = _prompt_ids(tok, kind, text)
        eng.reset_slot(0)
        refs.append((ids, generate(eng, ids, max_new_tokens=N_NEW, sampling=samp, eos_ids=tok.eos_ids).tokens))
    stop_ids = _prompt_ids(tok, "chat", STOP_PROMPT)
    long_ref = generate(eng, stop_ids, max_new_tokens=14, sampling=DEFAULT, eos_ids=tok.eos_ids).tokens
    words = [w for w in tok.decode(long_ref, skip_special=True).split(" ") if len(w) >= 2]
    assert len(words) >= 5, words
    stop = " " + words[3]  # a stop string the greedy answer reaches after a few tokens
    # the solo run with that stop string keeps the greedy tokens up to the one whose text completes it
    stop_ref = next(long_ref[:k] for k in range(1, len(long_ref) + 1)
                    if stop in tok.decode(long_ref[:k], skip_special=True))

    metrics = Metrics()
    records = []

    def on_window(rec):
        records.append(rec)
        metrics.on_window(rec)

    sch = BatchScheduler(eng, resolve_groups(2, 1), proposer_factory=LookupProposer, solo_spec=4, spec_policy=True,
                         on_window=on_window)
    loop = EngineLoop(sch, max_queue=16, on_step=metrics.on_step).start()
    app = create_app(loop, tok, model_id="smollm2-135m", max_context=CTX, vocab_size=eng.cfg.vocab_size,
                     defaults=oa.Defaults(N_NEW, DEFAULT), eos_ids=tok.eos_ids, metrics=metrics)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    t0 = time.time()
    while not server.started:
        assert time.time() - t0 < 60 and th.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield types.SimpleNamespace(url=url, engine=eng, tok=tok, loop=loop, sch=sch, metrics=metrics, records=records,
                                refs=refs, stop=stop, stop_ids=stop_ids, stop_ref=stop_ref, app=app,
                                client=openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                                     timeout=300))
    server.should_exit = True
    th.join(60)
    assert loop.close(drain=False, timeout=60)


def _ask(client, kind, text, samp, stream, **kw):
    """One request through the openai client; returns (text, token ids, finish reason, usage)."""
    args = dict(model="smollm2-135m", max_tokens=kw.pop("max_tokens", N_NEW), stream=stream,
                extra_body={"return_token_ids": True, **kw.pop("extra_body", {})}, **kw)
    if samp != DEFAULT:
        args.update(temperature=samp.temperature, seed=samp.seed)
        args["extra_body"]["top_k"] = samp.top_k
    if stream:
        args["stream_options"] = {"include_usage": True}
    if kind == "chat":
        r = client.chat.completions.create(messages=[{"role": "user", "content": text}], **args)
    else:
        r = client.completions.create(prompt=text, **args)
    if not stream:
        c = r.choices[0]
        return (c.message.content if kind == "chat" else c.text), c.model_extra["token_ids"], c.finish_reason, r.usage
    parts, ids, finish, usage = [], [], None, None
    for ch in r:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = c.delta.content if kind == "chat" else c.text
            parts.append(piece or "")
            ids += c.model_extra.get("token_ids") or []
            finish = c.finish_reason or finish
    return "".join(parts), ids, finish, usage


@pytest.mark.slow
def test_concurrent_requests_equal_solo_decode(served, model_path):
    """8 concurrent clients (greedy and seeded, chat and completions, streamed and not) on 2 slots: every answer
    is token for token the request's solo decode, its text the decoded tokens, usage and finish reason right."""
    n0 = len(served.records)
    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as ex:
        futs = [ex.submit(_ask, served.client, *case) for case in CASES]
        got = [f.result() for f in futs]
    tok = served.tok
    for (kind, prompt, samp, stream), (text, ids, finish, usage), (p_ids, ref) in zip(CASES, got, served.refs):
        assert ids == ref, (prompt, ids, ref)
        assert text == tok.decode(ref, skip_special=True), (prompt, text)
        assert finish == ("stop" if ref[-1] in tok.eos_ids else "length")
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(p_ids), len(ref),
                                                                                        len(p_ids) + len(ref))
    windows = served.records[n0:]
    assert any(w.mode == "serial" and w.segments == 2 for w in windows)  # requests shared windows
    assert served.loop.running == 0 and served.loop.queue_depth == 0
    # the same answer from strata-generate itself (its solo path, the same engine flags)
    kind, prompt, _, _ = CASES[0]
    proc = subprocess.run([sys.executable, "-m", "strata_jax.cli.generate", "--model", model_path("smollm2-135m"),
                           "--chat", "--prompt", prompt, "--max_new_tokens", str(N_NEW), "--max_context", str(CTX),
                           "--xla_cache_dir", ""], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == got[0][0].strip()


@pytest.mark.slow
def test_stop_string_streamed_and_not(served):
    """Generation stops at the token that completes the stop string (the solo run's tokens); the text ends before
    the stop string (OpenAI's rule), streamed (held back until it cannot start the stop string) and not."""
    tok = served.tok
    want_text = tok.decode(served.stop_ref, skip_special=True)
    want_text = want_text[:want_text.index(served.stop)]
    for stream in (False, True):
        text, ids, finish, _ = _ask(served.client, "chat", STOP_PROMPT, DEFAULT, stream, max_tokens=14,
                                    stop=[served.stop, "never-seen-stop"])
        assert ids == served.stop_ref and finish == "stop" and text == want_text, (stream, text, want_text)


@pytest.mark.slow
def test_disconnect_frees_the_slot(served):
    """A streaming client that goes away mid-stream: its request is cancelled at the next window boundary (at most
    one window finishes after the server learns of it) and the slot serves the next request."""
    loop, records = served.loop, served.records
    marks = []
    orig = loop.cancel

    def cancel(rid):
        marks.append(len(records))
        orig(rid)

    loop.cancel = cancel
    try:
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 60, "stream": True}
        with httpx.Client(timeout=300) as c:
            with c.stream("POST", served.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                n = 0
                for line in r.iter_lines():
                    n += line.startswith("data: ")
                    if n >= 3:
                        break
        t0 = time.time()
        while loop.running or not marks:
            assert time.time() - t0 < 60, "the slot was not freed"
            time.sleep(0.01)
        assert len(records) - marks[0] <= 1, (len(records), marks)
    finally:
        loop.cancel = orig
    # the outcome is counted when the request's handler finishes, which may come a moment after the slot is free
    want = 'strata_requests_total{endpoint="chat",outcome="cancelled"} 1.0'
    t0 = time.time()
    while want not in served.metrics.text()[0].decode() and time.time() - t0 < 10:
        time.sleep(0.05)
    assert want in served.metrics.text()[0].decode()
    assert _ask(served.client, "chat", "Hi", DEFAULT, False, max_tokens=2)[2] == "length"


@pytest.mark.slow
def test_full_queue_gets_429(served):
    """With both slots busy and --max_queue 0, one more request gets 429 with Retry-After (the openai client raises
    RateLimitError); the busy requests are not disturbed."""
    loop = served.loop
    body = {"prompt": "Once upon a time", "max_tokens": 20, "stream": True}
    with httpx.Client(timeout=300) as c, c.stream("POST", served.url + "/v1/completions", json=body) as a, \
            c.stream("POST", served.url + "/v1/completions", json=body) as b:
        lines = [a.iter_lines(), b.iter_lines()]
        for it in lines:
            assert next(it).startswith("data: ")  # both admitted: first tokens streamed
        loop.max_queue = 0
        try:
            with pytest.raises(openai.RateLimitError) as e:
                served.client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=2)
        finally:
            loop.max_queue = 16
        assert e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "rate_limit_exceeded"
        tails = ["".join(it) for it in lines]
    for t in tails:
        assert t.endswith("data: [DONE]") and '"finish_reason":"length"' in t.replace(" ", "")


def _is_chunk_of(prompt, kind, tokens, rows) -> bool:
    """An `Engine.run` call is the prefill chunk of exactly ``prompt`` (a prompt shorter than one chunk)."""
    n = int(np.asarray(rows.n_valid)[0])
    return kind == "prefill" and n == len(prompt) and np.asarray(tokens)[0, :n].tolist() == list(prompt)


@pytest.mark.slow
def test_request_in_prefill_holds_its_slot(served, monkeypatch):
    """A request whose prefill is running counts as running (/health) and holds its slot: with --max_queue 0 and
    two slots, one request in prefill and one waiting for the other slot, a third gets 429 at once; the two are
    answered once the prefill ends."""
    eng, loop = served.engine, served.loop
    marker = [9, 9, 9, 9, 9]
    in_prefill, release = threading.Event(), threading.Event()
    orig = eng.run

    def run(kind, tokens, rows, *args, **kw):  # every prompt chunk goes through Engine.run, whoever reads it
        if _is_chunk_of(marker, kind, tokens, rows):
            in_prefill.set()
            assert release.wait(120)
        return orig(kind, tokens, rows, *args, **kw)

    monkeypatch.setattr(eng, "run", run)
    loop.max_queue = 0
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        try:
            a = ex.submit(_ask, served.client, "completion", marker, DEFAULT, False, max_tokens=2)
            assert in_prefill.wait(120)
            h = httpx.get(served.url + "/health").json()
            assert (h["running"], h["queued"]) == (1, 0), h
            b = ex.submit(_ask, served.client, "completion", "Hi", DEFAULT, False, max_tokens=2)
            t0 = time.time()
            while loop.queue_depth < 1:  # b waits for the loop's thread, busy in a's prefill
                assert time.time() - t0 < 60 and not b.done(), "the second request was not queued"
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as e:
                served.client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=2)
            assert e.value.body["code"] == "rate_limit_exceeded"
            release.set()
            assert a.result()[2] == "length" and b.result()[2] == "length"
        finally:  # before the pool waits for a
            release.set()
            loop.max_queue = 16


@pytest.mark.slow
def test_engine_error_fails_one_request(served, monkeypatch):
    """An exception in one request's prefill fails that request (500, server_error, streamed or not); a request
    beside it is answered exactly, and the server stays healthy."""
    eng = served.engine
    marker = [7, 7, 7, 7, 7]
    orig = eng.run

    def run(kind, tokens, rows, *args, **kw):
        if _is_chunk_of(marker, kind, tokens, rows):
            raise RuntimeError("injected device fault")
        return orig(kind, tokens, rows, *args, **kw)

    monkeypatch.setattr(eng, "run", run)
    kind, prompt, samp, stream = CASES[2]
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        bad = [ex.submit(_ask, served.client, "completion", marker, DEFAULT, s) for s in (False, True)]
        good = ex.submit(_ask, served.client, kind, prompt, samp, stream)
        for f in bad:
            with pytest.raises(openai.InternalServerError) as e:
                f.result()
            assert "injected device fault" in e.value.body["message"] and e.value.body["type"] == "server_error"
        assert good.result()[1] == served.refs[2][1]
    assert httpx.get(served.url + "/health").json()["status"] == "ok"


BAD = [
    ("chat", b"{not json", None),
    ("chat", [1, 2], None),
    ("chat", {"max_tokens": 2}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "temperature": float("nan")}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "temperature": -0.5}, "temperature"),
    ("completion", {"prompt": "a", "temperature": 2.5}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_k": 5000}, "top_k"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "min_p": -0.1}, "min_p"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "seed": -1}, "seed"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1.5}, "max_completion_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stop": ""}, "stop"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5}, "frequency_penalty"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": -1}, "presence_penalty"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1}}, "logit_bias"),
    ("chat", {"messages": [{"role": "user", "content": "word " * 200}]}, "messages"),
    ("completion", {"prompt": "word " * 200}, "prompt"),
    ("completion", {"prompt": ["a", "b"]}, "prompt"),
    ("completion", {"prompt": [1, 10 ** 9]}, "prompt"),
    ("completion", {"prompt": ""}, "prompt"),
    ("completion", {"prompt": "a", "echo": True}, "echo"),
    ("completion", {"prompt": "a", "best_of": 3}, "best_of"),
    ("completion", {"prompt": "a", "logprobs": 2}, "logprobs"),
    ("chat", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ("completion", {"prompt": [1, 2, 3], "max_tokens": CTX}, "max_tokens"),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind, body, param", BAD, ids=[f"{k}-{p}-{i}" for i, (k, _, p) in enumerate(BAD)])
def test_bad_request_is_400_naming_the_field(served, kind, body, param):
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(served.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"], err
    if param:
        assert repr(param.split(".")[0].split("[")[0])[1:-1] in err["message"], err


@pytest.mark.slow
def test_model_field_unknown_404_missing_or_served_accepted(served):
    """'model' is the id /v1/models lists or left out; another gets 404 model_not_found naming the served id."""
    (listed,) = [m.id for m in served.client.models.list().data]
    for kind in ("chat", "completion"):
        with pytest.raises(openai.NotFoundError) as e:
            if kind == "chat":
                served.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=1)
            else:
                served.client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
        err = e.value.body
        assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error", err
        assert "'gpt-4'" in err["message"] and repr(listed) in err["message"], err
    for body in ({"prompt": "Hi", "max_tokens": 1}, {"prompt": "Hi", "max_tokens": 1, "model": listed}):
        r = httpx.post(served.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200 and r.json()["model"] == listed, r.text


@pytest.mark.slow
def test_routing_errors_have_the_openai_shape(served):
    for method, path, status, code in [("GET", "/v1/chat/completions", 405, "method_not_allowed"),
                                       ("GET", "/v1/nope", 404, "not_found"), ("POST", "/v1/models", 405,
                                                                               "method_not_allowed")]:
        r = httpx.request(method, served.url + path, timeout=60)
        assert r.status_code == status, (path, r.text)
        err = r.json()["error"]
        assert set(r.json()) == {"error"} and err["code"] == code and err["type"] == "invalid_request_error", err
        assert path in err["message"], err
    assert httpx.request("GET", served.url + "/v1/completions").headers["allow"] == "POST"


@pytest.mark.slow
def test_unknown_fields_ignored_and_logged_once(served, caplog):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "frobnicate": {"a": 1}}
    with caplog.at_level(logging.WARNING, logger="strata_jax.serve"):
        for _ in range(2):
            r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=300)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    hits = [rec for rec in caplog.records if "frobnicate" in rec.getMessage()]
    assert len(hits) == 1, [rec.getMessage() for rec in caplog.records]


@pytest.mark.slow
def test_models_health_metrics_and_api_key(served):
    from fastapi.testclient import TestClient

    from strata_jax.cli.server import create_app

    models = served.client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]
    one = served.client.models.retrieve("smollm2-135m")
    assert one.id == "smollm2-135m" and one.model_dump() == models.data[0].model_dump()
    r = httpx.get(served.url + "/v1/models/org/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    h = httpx.get(served.url + "/health").json()
    assert h["status"] == "ok" and h["slots"] == 2
    head = httpx.head(served.url + "/health")   # load balancers probe with HEAD
    assert head.status_code == 200 and head.content == b"", head
    served.client.completions.create(model="smollm2-135m", prompt="hi", max_tokens=2)  # windows to observe, alone too
    text = httpx.get(served.url + "/metrics").text
    for name in ("strata_requests_total", "strata_prompt_tokens_total", "strata_generated_tokens_total",
                 "strata_queue_depth", "strata_slots_busy", "strata_proposals_offered_total",
                 "strata_proposals_accepted_total", "strata_window_seconds_bucket", "strata_step_seconds_bucket",
                 "strata_time_to_first_token_seconds_bucket"):
        assert name in text, name
    assert "strata_slots 2.0" in text and "strata_step_programs_total 0.0" in text  # proposals: no step programs
    # an API key: the /v1 routes answer 401 without it (an app on the same loop; nothing decodes here)
    keyed = create_app(served.loop, served.tok, model_id="m", max_context=CTX, vocab_size=served.engine.cfg.vocab_size,
                       defaults=oa.Defaults(), api_key="s3cret")
    with TestClient(keyed) as c:
        for r in (c.get("/v1/models"), c.post("/v1/chat/completions", json={"messages": []}),
                  c.get("/v1/models", headers={"Authorization": "Bearer wrong"})):
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200


def _start_serve(model, *args):
    """A real strata-serve process (smollm2, 2 slots, context 64, a free port) and, once it listens, its address
    and the stderr lines printed until then."""
    proc = subprocess.Popen([sys.executable, "-m", "strata_jax.cli.serve", "--model", model, "--max_context", "64",
                             "--batch", "2", "--port", "0", *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, t0 = [], time.time()
    try:
        while not lines or "http://" not in lines[-1]:
            lines.append(proc.stderr.readline())
            assert lines[-1] or proc.poll() is None, "strata-serve exited before listening:\n" + "".join(lines)
            assert time.time() - t0 < 300
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, lines[-1].split("http://")[1].split()[0], lines


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_before_serving_and_twice(model_path, sig):
    """A real strata-serve process: SIGINT / SIGTERM during the warm-up exits at once with 128 + the signal and one
    line ('interrupted' / 'terminated'; Python's Ctrl-C had been lost in a JAX gc callback, SIGTERM had said
    nothing); while serving, the signal twice exits at once (the first starts the drain) with no traceback,
    instead of decoding every open request to its end."""
    model = model_path("smollm2-135m")
    word = "interrupted" if sig == signal.SIGINT else "terminated"
    proc = subprocess.Popen([sys.executable, "-m", "strata_jax.cli.serve", "--model", model, "--max_context", "64",
                             "--port", "0", "--xla_cache_dir", ""], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        while not lines or not lines[-1].startswith("warming up"):
            lines.append(proc.stderr.readline())
            assert lines[-1], "".join(lines)
        proc.send_signal(sig)
        t0 = time.time()
        rc = proc.wait(60)
        rest = proc.stderr.read()
        assert rc == 128 + sig and time.time() - t0 < 10, (rc, rest)
        assert rest.strip().splitlines()[-1] == word and "Traceback" not in rest, rest
    finally:
        proc.kill()
        proc.wait()
    proc, url, _ = _start_serve(model, "--nowarmup", "--xla_cache_dir", "")
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 40, "stream": True}
        with httpx.Client(timeout=300) as c, c.stream("POST", f"http://{url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):   # the request is decoding
                    proc.send_signal(sig)
                    time.sleep(0.3)
                    proc.send_signal(sig)
                    t0 = time.time()
                    break
        rc = proc.wait(60)
        rest = proc.stderr.read()
        assert rc == 128 + sig and time.time() - t0 < 10, (rc, rest)
        assert "again: exiting without finishing the open requests" in rest and "Traceback" not in rest, rest
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_sigterm_drains_and_exits(model_path, tmp_path):
    """A real strata-serve process: SIGTERM while a stream runs lets it finish (every token, [DONE]), refuses new
    connections, and exits with status 0."""
    proc, url, _ = _start_serve(model_path("smollm2-135m"), "--nowarmup", "--xla_cache_dir", "")
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 12, "stream": True, "return_token_ids": True}
        ids, finish, done, sent = [], None, False, False
        with httpx.Client(timeout=300) as c, c.stream("POST", f"http://{url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                d = json.loads(line[6:])
                ids += d["choices"][0].get("token_ids", [])
                finish = d["choices"][0]["finish_reason"] or finish
                if ids and not sent:  # the first tokens arrived: the request is decoding
                    sent = True
                    proc.send_signal(signal.SIGTERM)
                    t1 = time.time()
                    while True:  # the listening socket closes at once; the stream goes on
                        try:
                            httpx.get(f"http://{url}/health", timeout=5)
                        # refused, closed unanswered, or reset (accepted as the listener closed): not served
                        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                            break
                        assert time.time() - t1 < 30, "still accepting connections after SIGTERM"
                        time.sleep(0.2)
        assert done and finish == "length" and len(ids) == 12
        assert proc.wait(timeout=120) == 0
        assert "strata-serve: stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the command line of strata-serve: checks before anything is loaded -------------------------------------------
NO_MODEL = os.path.join(os.path.dirname(__file__), "no-such-model.gguf")  # never reached: the checks fire first


def _serve(*args):
    return subprocess.run([sys.executable, "-m", "strata_jax.cli.serve", *args], capture_output=True, text=True,
                          timeout=300)


def test_serve_flag_errors_before_load():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        for args, needles in [
            (["--draft", "lookup", "--spec", "20"], ["--spec 20", "2..8"]),
            (["--spec", "6"], ["--spec 6 needs --draft"]),
            (["--batch", "2", "--batch_groups", "3"], ["--batch_groups 3", "1..2"]),
            (["--api_key", " "], ["--api_key", "empty key"]),
            (["--top_p", "0"], ["--top_p 0", "(0, 1]"]),
            (["--temperature", "5"], ["--temperature 5.0", "[0, 2]"]),
            (["--port", str(busy.getsockname()[1])], ["cannot listen there"]),
            (["--port", "0", "stray"], ["unexpected argument 'stray'"]),
            (["--port", "0"], ["no such file", "no-such-model"]),  # the flags pass: the model is the first error
        ]:
            proc = _serve("--model", NO_MODEL, *args)
            line = proc.stderr.strip().splitlines()[-1]
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr[-2000:])
            assert line.startswith("error: ") and all(n in line for n in needles), (args, line)
    finally:
        busy.close()
    # the warm-up's compile ahead: a bad STRATA_COMPILE_AHEAD is the first error (the model is not reached)
    proc = subprocess.run([sys.executable, "-m", "strata_jax.cli.serve", "--model", NO_MODEL, "--port", "0"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "STRATA_COMPILE_AHEAD": "yes"})
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert line.startswith("error: ") and "STRATA_COMPILE_AHEAD='yes'" in line and "no-such-model" not in line, line


def test_serve_refuses_a_model_without_tokenizer():
    """A GGUF whose tokenizer cannot be built (the qwen35 fixture's toy vocabulary) is refused from its header with
    one line naming the cause, before the weights load."""
    fix = os.path.join(os.path.dirname(__file__), "fixtures", "hybrid", "qwen35_q8_0.gguf")
    proc = _serve("--model", fix, "--max_context", "64", "--port", "0", "--nowarmup")
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert line.startswith("error: strata-serve needs the model's tokenizer") and "cannot build it" in line, line
    assert "loaded in" not in proc.stderr, proc.stderr


def test_serve_help_lists_its_flags_and_the_shared_ones():
    proc = _serve("--help")
    assert proc.returncode == 0
    out = proc.stdout
    assert "strata_jax.cli.serve:" in out and "strata_jax.cli.flags:" in out and "__main__:" not in out
    for flag in ("--host", "--port", "--api_key", "--max_queue", "--model", "--batch", "--piped_mtp", "--spec"):
        assert f"\n  {flag}:" in out or f"\n  --[no]{flag[2:]}:" in out, flag


@pytest.mark.slow
@pytest.mark.parametrize("n_steps", [1, 3])
def test_warmup_compiles_what_a_lone_request_runs(served, monkeypatch, n_steps):
    """strata-serve's warm-up (the default scheduler: no --draft; one step per program, or 3 with --decode_steps 3)
    leaves nothing to compile for a request alone or for --batch requests at once: on a fresh compile cache, the
    warm-up's functions (its programs of 3 steps for 1 and 2 slots included) are every function they run. /metrics
    counts the scheduler's programs of several steps."""
    from strata_jax.cli.serve import _warmup
    from strata_jax.cli.server import Metrics
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.loop import EngineLoop
    from strata_jax.pipeline.scheduler import BatchScheduler, Request
    from strata_jax.pipeline.windows import CompileCache, describe_key

    eng, tok = served.engine, served.tok
    for key in eng.cache._fns:  # whatever the tests before have compiled: every key in words
        assert not describe_key(key).startswith("("), key
    monkeypatch.setattr(eng, "cache", CompileCache(eng.cache.capacity))
    sch = BatchScheduler(eng, resolve_groups(2, 1), decode_steps=n_steps)
    loop = EngineLoop(sch).start()
    metrics = Metrics(loop)
    try:
        _warmup(loop, eng, tok, sampled=False)
        warm, n_warm = set(eng.cache._fns), eng.cache.compiles
        assert any(k[1] == "step" and k[2] == 1 for k in warm) and any(k[1] == "step" and k[2] == 2 for k in warm)
        steps = {k[2] for k in warm if k[1] == "steps"}
        assert steps == ({1, 2} if n_steps > 1 else set()) and all(k[3] == n_steps for k in warm if k[1] == "steps")
        ids = _prompt_ids(tok, "chat", "Name a color.")
        loop.submit(Request(ids, 9, DEFAULT)).wait(300)  # 1 + 3 x 2 in programs of 3 steps + 2 single steps
        for x in loop.submit_all([Request(ids, 9, DEFAULT) for _ in range(2)]):
            x.wait(300)
        assert set(eng.cache._fns) == warm and eng.cache.compiles == n_warm, set(eng.cache._fns) - warm
        assert {k[1] for k in warm} >= {"prefill", "step", "reset"}
        for key in warm:
            assert not describe_key(key).startswith("("), key
        n_sp = sch.stats["step_programs"]
        assert (n_sp > 0) == (n_steps > 1)
        assert f"strata_step_programs_total {float(n_sp)}" in metrics.text()[0].decode()
    finally:
        assert loop.close(timeout=60)


@pytest.mark.slow
def test_warmup_sampled_rounds(served, monkeypatch):
    """strata-serve's warm-up (--decode_steps 3, 2 slots) with its sampled rounds (the default, --warmup_sampled)
    leaves no XLA compile for sampled requests after it -- one alone, two at once, a greedy one beside a sampled
    one -- while greedy rounds alone leave the sampled programs to the first sampled request (what the flag is
    for). The sampled rounds' tokens do not leak into the requests after them: a seeded request gives the same
    tokens either way."""
    import jax

    from strata_jax.cli.serve import _warmup
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.loop import EngineLoop
    from strata_jax.pipeline.scheduler import BatchScheduler, Request
    from strata_jax.pipeline.windows import CompileCache

    eng, tok = served.engine, served.tok
    compiles = []

    def on_duration(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kw.get("fun_name"))

    ids = _prompt_ids(tok, "chat", "Name a color.")
    other = _prompt_ids(tok, "completion", "Once upon a time")

    def warm_and_ask(sampled: bool):
        monkeypatch.setattr(eng, "cache", CompileCache(eng.cache.capacity))
        loop = EngineLoop(BatchScheduler(eng, resolve_groups(2, 1), decode_steps=3)).start()
        jax.monitoring.register_event_duration_secs_listener(on_duration)
        try:
            _warmup(loop, eng, tok, sampled=sampled)
            compiles.clear()
            alone = loop.submit(Request(ids, 9, _seeded(21))).wait(300).tokens
            both = [x.wait(300).tokens for x in loop.submit_all([Request(other, 9, _seeded(22)),
                                                                 Request(ids, 9, _seeded(21))])]
            mixed = [x.wait(300).tokens for x in loop.submit_all([Request(other, 9, DEFAULT),
                                                                  Request(ids, 9, _seeded(21))])]
            return list(compiles), [alone, *both, *mixed]
        finally:
            jax.monitoring.unregister_event_duration_listener(on_duration)
            assert loop.close(timeout=60)

    after_sampled, out = warm_and_ask(True)
    assert after_sampled == [], after_sampled
    after_greedy, out0 = warm_and_ask(False)
    assert any(f == "jit(fn)" for f in after_greedy), after_greedy   # the sampled programs compiled only now
    assert out == out0 and all(out) and out[0] == out[2] == out[4], (out, out0)   # seeded: the same tokens


@pytest.mark.slow
def test_warmup_compiles_the_step_programs_ahead(served, monkeypatch):
    """strata-serve's warm-up with --decode_steps 3 starts compiling the programs of 3 steps it runs (for 1 row and
    for a row per slot, 2) in background threads before its rounds (`BatchScheduler.compile_steps_ahead`): each is
    traced and compiled once, in its thread, and the rounds' first programs of 3 steps run those (the loop's thread
    compiles 2 programs fewer than without compile-ahead, nothing is traced again); the warm-up line counts them.
    With STRATA_COMPILE_AHEAD=0 none starts, and the tokens of a request alone and of 2 at once after the warm-up
    are the same."""
    import jax

    from strata_jax.cli import flags as shared
    from strata_jax.cli.serve import _warmup
    from strata_jax.pipeline import engine as engine_mod
    from strata_jax.pipeline import stages
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.loop import EngineLoop
    from strata_jax.pipeline.scheduler import BatchScheduler, Request
    from strata_jax.pipeline.windows import AHEAD_THREAD, CompileCache

    eng, tok = served.engine, served.tok
    res = resolve_groups(2, 1)
    assert BatchScheduler(eng, res, decode_steps=3).step_program_rows == [1, 2]
    assert BatchScheduler(eng, res, decode_steps=3, solo_return=False).step_program_rows == [2]
    assert BatchScheduler(eng, res, decode_steps=1).step_program_rows == []
    traces, compiles = [], []   # (thread, rows, steps) per trace of a steps program; (thread) per 'fn' XLA compile
    real_build, real_body = stages.build_steps_fn, stages.stage_fn_body

    def counting_build(stage, n_steps, max_context, ple_ids=None):
        def body(*a, **k):
            inner = real_body(*a, **k)

            def traced(params, state, token, *rest):
                traces.append((threading.current_thread().name, token.shape[0], n_steps))
                return inner(params, state, token, *rest)
            return traced

        stages.stage_fn_body = body   # read by build_steps_fn when it builds, not when it traces
        try:
            return real_build(stage, n_steps, max_context, ple_ids)
        finally:
            stages.stage_fn_body = real_body

    def on_duration(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration" and kw.get("fun_name") == "jit(fn)":
            compiles.append(threading.current_thread().name)   # a stage, steps or commit program (not a reset)

    monkeypatch.setattr(engine_mod, "build_steps_fn", counting_build)
    ids = _prompt_ids(tok, "chat", "Name a color.")
    other = _prompt_ids(tok, "completion", "Once upon a time")
    keys = [(0, "steps", 1, 3, 2), (0, "steps", 2, 3, 2)]

    def warm_and_ask(ahead: str):
        monkeypatch.setenv("STRATA_COMPILE_AHEAD", ahead)
        monkeypatch.setattr(eng, "cache", CompileCache(eng.cache.capacity))
        traces.clear()
        compiles.clear()
        sch = BatchScheduler(eng, res, decode_steps=3)
        loop = EngineLoop(sch).start()
        jax.monitoring.register_event_duration_secs_listener(on_duration)
        try:
            started = _warmup(loop, eng, tok, sampled=False)
            warm_traces, warm_compiles, n_warm = list(traces), list(compiles), eng.cache.compiles
            summary = shared.compile_summary([eng.cache])
            alone = loop.submit(Request(ids, 9, DEFAULT)).wait(300).tokens
            both = [x.wait(300).tokens for x in loop.submit_all([Request(other, 9, DEFAULT), Request(ids, 9, DEFAULT)])]
            # nothing traced or compiled after the warm-up, and its rounds ran programs of 3 steps
            assert traces == warm_traces and compiles == warm_compiles and eng.cache.compiles == n_warm
            assert sch.stats["step_programs"] > 0 and all(k in eng.cache._fns for k in keys), set(eng.cache._fns)
            return started, warm_traces, warm_compiles, summary, [alone, *both]
        finally:
            jax.monitoring.unregister_event_duration_listener(on_duration)
            assert loop.close(timeout=60)

    started, tr, comp, summary, out = warm_and_ask("1")
    cache = eng.cache
    assert started == keys and cache.ahead_started == cache.ahead_used == 2 and not cache._ahead
    # each program traced once, in its own background thread: the first real call reused the jitted object
    assert sorted(tr) == [(f"{AHEAD_THREAD}-{k}", k[2], 3) for k in keys], tr
    ahead_compiles = [t for t in comp if t.startswith(AHEAD_THREAD)]
    assert len(ahead_compiles) == 2 and len(set(ahead_compiles)) == 2, comp
    assert re.search(r"^(compiled|built) \d+ functions \(2 ahead\) in [\d.]+ s; ", summary), summary

    started0, tr0, comp0, summary0, out0 = warm_and_ask("0")
    assert started0 == [] and eng.cache.ahead_started == eng.cache.ahead_used == 0 and "ahead" not in summary0
    assert sorted((t, b, n) for t, b, n in tr0) == [("strata-engine-loop", 1, 3), ("strata-engine-loop", 2, 3)], tr0
    assert not any(t.startswith(AHEAD_THREAD) for t in comp0)
    assert comp.count("strata-engine-loop") + 2 == comp0.count("strata-engine-loop") == len(comp0), (comp, comp0)
    assert out == out0 and all(out) and out[0] == out[2], (out, out0)   # greedy: the same prompt, the same tokens


@pytest.mark.slow
def test_serve_warmup_compiles_the_step_programs(model_path, tmp_path):
    """strata-serve --decode_steps 3: the warm-up line says what it compiled (the programs of 3 steps ahead) and what
    the XLA cache read and wrote (a second start reads every program back, compiles none); a request after it
    compiles nothing (/metrics) and runs programs of 3 steps, which /metrics counts."""
    def metric(text, name):
        return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name + " ")))

    xla = str(tmp_path / "xla")
    for run in range(2):
        proc, url, lines = _start_serve(model_path("smollm2-135m"), "--decode_steps", "3", "--xla_cache_dir", xla,
                                        "--nowarmup_sampled")   # greedy rounds only (test_warmup_sampled_rounds)
        try:
            assert "warming up: 1 request of 5 tokens, then 2 at once of 6 tokens, greedy ...\n" in lines, lines
            warm = next(ln for ln in lines if ln.startswith("warmed up in "))
            m = re.search(r": built (\d+) functions \(2 ahead\) in [\d.]+ s; XLA cache: (\d+) read, (\d+) compiled "
                          r"and written$", warm.strip())
            assert m and int(m[1]) >= 6, warm  # prefill, reset, a step and a program of 3 steps for 1 and 2 slots
            # (those two built ahead, in background threads: the warm-up's compile ahead)
            read, written = int(m[2]), int(m[3])
            assert (read == 0 and written > 0) if run == 0 else (read > 0 and written == 0), warm
            before = httpx.get(f"http://{url}/metrics").text
            r = httpx.post(f"http://{url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 9},
                           timeout=300)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 9
            after = httpx.get(f"http://{url}/metrics").text
            assert metric(after, "strata_compiles") == metric(before, "strata_compiles") == int(m[1])
            assert metric(after, "strata_step_programs_total") >= metric(before, "strata_step_programs_total") + 2
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_unseeded_sampled_requests_draw_fresh_seeds():
    """A server started without --seed (`Defaults.fresh_seeds`) gives each sampled request without a seed a fresh
    random one (OpenAI clients expect unseeded requests to vary); a request's seed, greedy requests and a server
    --seed stay as given."""
    def sampling(body, fresh, default=SamplingParams(0.0, seed=7)):
        d = oa.Defaults(8, default, fresh_seeds=fresh)
        return oa.parse_request({"prompt": [1, 2, 3], **body}, oa.COMPLETION, tokenizer=None, max_context=64,
                                vocab_size=100, defaults=d).sampling

    seeds = {sampling({"temperature": 0.7}, True).seed for _ in range(8)}
    assert len(seeds) >= 7 and all(0 <= s <= SEED_MAX for s in seeds), seeds
    assert sampling({"temperature": 0.7, "seed": 5}, True).seed == 5
    assert sampling({}, True).seed == 7                                   # greedy: the seed is not used
    assert sampling({"temperature": 0.7}, False).seed == 7                # the server's --seed
    hot = SamplingParams(0.8, seed=7)                                     # the server's --temperature 0.8
    assert len({sampling({}, True, hot).seed for _ in range(8)}) >= 7


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1], "temperature": 10 ** 400}, "temperature"),        # JSON's 1000...0: float() overflows
    ({"prompt": [1], "top_p": 10 ** 400}, "top_p"),
    ({"prompt": [1], "frequency_penalty": 10 ** 400}, "frequency_penalty"),
    ({"prompt": [1], "seed": 10 ** 400}, "seed"),
    ({"prompt": "a\ud800b"}, "prompt"),                                 # JSON's "\ud800": an unpaired surrogate
    ({"prompt": [1], "stop": ["\udc00"]}, "stop[0]"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages[0].content[0].text"),
    ({"prompt": [1], "\ud800": 1}, None),                                # a key: the object holding it
    ({"prompt": [1], "n": 10 ** 400}, "n"),
    ({"prompt": [1], "best_of": 10 ** 400}, "best_of"),
    ({"prompt": [1], "max_tokens": -10 ** 400}, "max_tokens"),
    ({"prompt": [1], "top_k": 10 ** 400}, "top_k"),
    ({"prompt": [10 ** 400]}, "prompt"),
])
def test_absurd_numbers_and_invalid_unicode_are_400_not_500(body, param):
    """Values a JSON body can carry that Python's float() or the tokenizer cannot take: a 400 naming the field
    (these were 500s: OverflowError, 'TextInputSequence must be str'), checked before the tokenizer is needed."""
    kind = oa.CHAT if "messages" in body else oa.COMPLETION
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request(body, kind, tokenizer=None, max_context=64, vocab_size=100, defaults=oa.Defaults())
    assert e.value.status == 400 and e.value.param == param, (e.value.status, e.value.param, e.value.message)
    assert len(e.value.message) < 200, e.value.message                   # a 400-digit number is cut in the message


@pytest.mark.parametrize("body, param, needle", [
    ({"messages": [{"content": "Hi"}]}, "messages[0].role", "'messages[0].role': missing"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text",
     "'messages[0].content[0].text': missing"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text",
     "must be a string"),
    ({"prompt": [1], "temperature": float("nan")}, "temperature", "must lie in [0, 2]"),
    ({"prompt": [1], "temperature": float("inf")}, "temperature", "must lie in [0, 2]"),
    ({"prompt": [1], "temperature": -1}, "temperature", "must lie in [0, 2]"),
    ({"prompt": [1, 2, 3], "max_tokens": 62}, "max_tokens", "at most 61 tokens can be generated"),
    ({"prompt": [1, 2, 3], "max_completion_tokens": 100}, "max_completion_tokens", "at most 61 tokens"),
])
def test_request_field_errors_name_the_field(body, param, needle):
    """A role or a text part left out is 'missing' (not a list of roles, not 'got text'); every bad temperature
    gets the same range message; a max_tokens the context cannot reach is refused as OpenAI's API refuses it
    (64 cells, a 3-token prompt: 61 tokens fit)."""
    kind = oa.CHAT if "messages" in body else oa.COMPLETION
    with pytest.raises(oa.ApiError) as e:
        oa.parse_request(body, kind, tokenizer=None, max_context=64, vocab_size=100, defaults=oa.Defaults())
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message, e.value.message
    ok = dict(body, **{param: 61}) if param.startswith("max_") else None
    if ok is not None:  # the largest limit that fits is accepted
        assert oa.parse_request(ok, kind, tokenizer=None, max_context=64, vocab_size=100,
                                defaults=oa.Defaults()).max_tokens == 61


def test_deep_json_and_oversized_bodies_are_4xx():
    """A body nested past json's recursion limit is a 400 (it was a 500 with a traceback in the log); a body over
    max_request_bytes is a 413 whether its Content-Length says so or it arrives chunked, before the tokenizer runs."""
    from fastapi.testclient import TestClient

    from strata_jax.cli.server import create_app

    loop = types.SimpleNamespace(alive=True, error=None, n_slots=1, queue_depth=0, running=0,
                                 sch=types.SimpleNamespace(decode_steps=1, stats={"step_programs": 0}))
    app = create_app(loop, None, model_id="m", max_context=64, vocab_size=100, defaults=oa.Defaults(),
                     max_request_bytes=4096)
    deep = b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    big = json.dumps({"prompt": "a" * 5000}).encode()
    app2 = create_app(loop, None, model_id="m", max_context=64, vocab_size=100, defaults=oa.Defaults())
    with TestClient(app2, raise_server_exceptions=False) as c2:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = c2.post(path, content=deep, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and "nested too deeply" in err["message"], err
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
        assert "4096 bytes" in r.json()["error"]["message"]
        r = c.post("/v1/completions", content=iter([big[:3000], big[3000:]]),
                   headers={"content-type": "application/json"})   # chunked: no Content-Length
        assert r.status_code == 413, r.text[:300]


def test_invalid_unicode_and_huge_numbers_over_http_are_400():
    """The same bodies as raw JSON through the app (an engine loop that never runs: these fail before any
    submission, and before the tokenizer is needed): 400 in the OpenAI error shape, naming the field, with a short
    message; a 5000-digit integer (json.loads refuses it) is a 400 too."""
    from fastapi.testclient import TestClient

    from strata_jax.cli.server import create_app

    loop = types.SimpleNamespace(alive=True, error=None, n_slots=1, queue_depth=0, running=0,
                                 sch=types.SimpleNamespace(decode_steps=1, stats={"step_programs": 0}))
    app = create_app(loop, None, model_id="m", max_context=64, vocab_size=100, defaults=oa.Defaults())
    cases = [("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt", "not valid Unicode"),
             ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
              "messages[0].content", "not valid Unicode"),
             ("/v1/completions", b'{"prompt": [1], "temperature": 1' + b"0" * 400 + b"}", "temperature",
              "must lie in [0, 2]"),
             ("/v1/completions", b'{"prompt": [1], "seed": 1' + b"0" * 5000 + b"}", None, "not valid JSON")]
    with TestClient(app) as c:
        for path, raw, param, needle in cases:
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, raw[:60], r.status_code, r.text[:500])
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param, err
            assert needle in err["message"] and len(err["message"]) < 300, err


def test_warmup_reads_prompts_at_share_one():
    """The warm-up's rounds run with a chunk before every window (``read_share`` 1, whatever --batch_read_share
    says: with less, the first requests of a round of every slot would end before the last prompts were read, and
    the windows of every slot at once would compile at a client's first burst instead); the share is restored."""
    from types import SimpleNamespace

    from strata_jax.cli.serve import _warmup

    seen = []

    class Sch:
        engine = SimpleNamespace(n_slots=4, max_context=64)
        decode_steps = 1
        read_share = 0.3

        def compile_steps_ahead(self, sampling):
            return []

    class Loop:
        sch = Sch()

        def submit_all(self, reqs):
            seen.append((len(reqs), self.sch.read_share))
            return [SimpleNamespace(wait=lambda: None) for _ in reqs]

    loop = Loop()
    _warmup(loop, loop.sch.engine, SimpleNamespace(encode=lambda text: [1, 2, 3]), sampled=True)
    assert seen == [(1, 1.0), (4, 1.0)] * 2 and loop.sch.read_share == 0.3
