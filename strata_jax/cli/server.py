"""The HTTP server of ``strata-serve``: an OpenAI-compatible API (FastAPI) over an `EngineLoop`.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON, or server-sent events with ``"stream":
true``; bodies checked by `strata_jax.cli.openai_api.parse_request`), ``GET /v1/models`` (and ``/v1/models/{id}``),
``GET /health`` (200 while the engine loop runs, else 503) and ``GET /metrics`` (Prometheus text: requests by
outcome, prompt and generated tokens, queue depth, busy slots, proposals offered / accepted, programs of several
decode steps, window latency by mode, scheduler step latency, time to first token, request latency). With
``api_key`` the ``/v1`` routes need ``Authorization: Bearer KEY`` (401 otherwise).

A request is read (413 past `max_request_bytes`), tokenized and checked here (in a worker thread, so a long
prompt does not hold up the other streams), then submitted to the loop (a full queue: 429 with ``Retry-After``). The
answer waits for the first event of its stream: a request that failed before its first token gets its error status
(400 / 500) instead of a stream. Every error body, routing errors (404, 405) included, has the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``; a request naming a model other than the served one gets 404
``model_not_found``. A client that goes away (during the stream or while waiting) cancels its request,
so its slot is free at the next window boundary.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata_jax.cli import openai_api as oa
from strata_jax.pipeline.loop import EngineLoop, LoopClosed, QueueFull, StreamEvent
from strata_jax.pipeline.scheduler import Request, WindowRecord
from strata_jax.pipeline.sequence import stop_strings

log = logging.getLogger("strata_jax.serve")

MAX_REQUEST_BYTES = 8 << 20  # request bodies over this get 413 (strata-serve --max_request_mb)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _ReadCounter:
    """A Prometheus counter whose value ``read()`` gives at each scrape (prometheus_client's Counter holds its
    own)."""

    def __init__(self, name: str, doc: str, read):
        self.name, self.doc, self.read = name, doc, read

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily(self.name, self.doc, value=self.read())


class Metrics:
    """The server's Prometheus metrics, in their own registry (several servers may live in one process). Feed it
    with the scheduler's ``on_window`` and the loop's ``on_step``; `watch` adds the loop's gauges."""

    def __init__(self, loop: EngineLoop | None = None):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("strata_requests", "Requests answered, by endpoint and outcome (stop, length, "
                                "cancelled, error, refused, rejected)", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens read", registry=r)
        self.generated_tokens = Counter("strata_generated_tokens", "Tokens generated", registry=r)
        self.proposals_offered = Counter("strata_proposals_offered", "Proposals offered to verify windows",
                                         registry=r)
        self.proposals_accepted = Counter("strata_proposals_accepted", "Proposals accepted by verify windows",
                                          registry=r)
        self.compiled_windows = Counter("strata_compiled_windows", "Windows during which something compiled (left "
                                        "out of the window latency)", registry=r)
        self.window_seconds = Histogram("strata_window_seconds", "Latency of a verify window (launch to picks "
                                        "read), by mode; windows that compiled left out", ["mode"],
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("strata_step_seconds", "Latency of one scheduler step (admissions + a window "
                                      "or a pipeline tick)", buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("strata_time_to_first_token_seconds", "Request received to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("strata_request_seconds", "Request received to last token", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.loop = None
        if loop is not None:
            self.watch(loop)

    def watch(self, loop: EngineLoop) -> None:
        """Gauges read from ``loop`` at each scrape: queue depth, busy slots, slots; and the scheduler's
        ``step_programs`` as the counter ``strata_step_programs_total``."""
        from prometheus_client import Gauge

        if self.loop is not None:
            return
        self.loop = loop
        r = self.registry
        Gauge("strata_queue_depth", "Requests waiting for a slot", registry=r).set_function(lambda: loop.queue_depth)
        Gauge("strata_slots_busy", "Slots holding a request (in prefill or decoding)", registry=r).set_function(lambda: loop.running)
        Gauge("strata_slots", "Batch slots (--batch)", registry=r).set(loop.n_slots)
        r.register(_ReadCounter("strata_step_programs", f"Device programs of several plain decode steps "
                                f"(--decode_steps: {loop.sch.decode_steps} per program)",
                                lambda: loop.sch.stats["step_programs"]))

    def watch_compiles(self, caches, xla=None) -> None:
        """Gauges read at each scrape: functions compiled and seconds spent compiling (the `CompileCache` objects
        ``caches``: the target's, a draft model's), and with ``xla`` (an `XlaCacheStats`) the programs read from and
        written to the persistent compilation cache."""
        from prometheus_client import Gauge

        r = self.registry
        Gauge("strata_compiles", "Functions compiled (first calls of a window shape)",
              registry=r).set_function(lambda: sum(c.compiles for c in caches))
        Gauge("strata_compile_seconds", "Seconds spent in first calls (tracing, compiling or reading the XLA "
              "cache, first run)", registry=r).set_function(lambda: sum(c.compile_seconds for c in caches))
        if xla is not None:
            Gauge("strata_xla_cache_read", "Programs read from the persistent compilation cache",
                  registry=r).set_function(lambda: xla.hits)
            Gauge("strata_xla_cache_written", "Programs compiled and written to the persistent compilation cache",
                  registry=r).set_function(lambda: xla.written)

    def on_window(self, rec: WindowRecord) -> None:
        self.proposals_offered.inc(rec.proposed)
        self.proposals_accepted.inc(rec.accepted)
        if rec.compiled:
            self.compiled_windows.inc()
        else:
            self.window_seconds.labels(rec.mode).observe(rec.seconds)

    def on_step(self, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _sse(d) -> str:
    return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"


async def _disconnected(request) -> None:
    """Returns once the client has gone (the body is already read, so the next message is the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def create_app(loop: EngineLoop, tokenizer, *, model_id: str, max_context: int, vocab_size: int,
               defaults: oa.Defaults, eos_ids=(), api_key: str | None = None, metrics: Metrics | None = None,
               on_shutdown=None, max_request_bytes: int = MAX_REQUEST_BYTES):
    """The FastAPI app of ``strata-serve`` (see the module doc).

    Args:
      loop: a started `EngineLoop` (its scheduler's ``on_window`` / the loop's ``on_step`` may feed ``metrics``).
      tokenizer: the model's tokenizer (prompts, chat template, text).
      model_id: the id ``/v1/models`` lists and the answers name; a request naming another model gets 404.
      max_context, vocab_size: the engine's limits (prompt checks).
      defaults: values of fields a request leaves out.
      eos_ids: ids that end a generation.
      api_key: required bearer token of the ``/v1`` routes (None: open).
      metrics: the `Metrics` to serve at ``/metrics`` (default: a new one).
      on_shutdown: called when the app shuts down (after uvicorn has let the open requests finish).
      max_request_bytes: a larger request body gets 413 (``request_too_large``) before it is read whole.
    """
    from contextlib import asynccontextmanager

    metrics = metrics or Metrics()
    metrics.watch(loop)
    logged_unknown: set = set()
    started = int(time.time())
    model_ids = (model_id,)  # what /v1/models lists: the only 'model' a request may name

    @asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="strata-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    app.state.loop = loop

    def error(e: oa.ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def check_key(request: HttpRequest) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise oa.ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' (--api_key)",
                              code="invalid_api_key")

    @app.exception_handler(oa.ApiError)
    async def api_error(request, e: oa.ApiError):
        return error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        # routing errors (404 unknown path, 405 wrong method) in the OpenAI shape, not FastAPI's {"detail": ...}
        detail = str(e.detail)
        return error(oa.ApiError(e.status_code, f"{detail}: {request.method} {request.url.path}",
                                 code=detail.lower().replace(" ", "_"), headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return error(oa.ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers probe with it
    async def health():
        d = {"status": "ok" if loop.alive else "error", "slots": loop.n_slots, "running": loop.running,
             "queued": loop.queue_depth}
        if loop.error is not None:
            d["error"] = f"{type(loop.error).__name__}: {loop.error}"
        return JSONResponse(d, status_code=200 if loop.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        body, ctype = metrics.text()
        return Response(body, media_type=ctype)

    def model_card(m: str) -> dict:
        return {"id": m, "object": "model", "created": started, "owned_by": "strata_jax", "max_model_len": max_context}

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        check_key(request)
        return {"object": "list", "data": [model_card(m) for m in model_ids]}

    @app.get("/v1/models/{model:path}")   # the openai client's models.retrieve (an id may hold '/')
    async def model(model: str, request: HttpRequest):
        check_key(request)
        if model not in model_ids:
            raise oa.ApiError(404, f"The model {model!r} does not exist: this server serves {model_id!r}",
                              param="model", code="model_not_found")
        return model_card(model)

    async def read_body(request: HttpRequest) -> bytes:
        """The body, refused with 413 past ``max_request_bytes`` (by its Content-Length before reading, or as it
        arrives)."""
        too_big = oa.ApiError(413, f"the request body is over this server's limit of {max_request_bytes} bytes "
                                   f"(--max_request_mb)", code="request_too_large")
        n = request.headers.get("content-length", "")
        if n.isdigit() and int(n) > max_request_bytes:
            raise too_big
        chunks, size = [], 0
        async for c in request.stream():
            size += len(c)
            if size > max_request_bytes:
                raise too_big
            chunks.append(c)
        return b"".join(chunks)

    def parse(raw: bytes, kind: str) -> oa.ParsedRequest:
        """The body decoded and checked, its prompt tokenized (in a worker thread: a long prompt must not hold up
        the other clients' streams)."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: arrays / objects nested too deep
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise oa.bad(None, f"the request body is not valid JSON: {why}") from None
        return oa.parse_request(body, kind, tokenizer=tokenizer, max_context=max_context, vocab_size=vocab_size,
                                defaults=defaults)

    async def complete(request: HttpRequest, kind: str):
        endpoint = "chat" if kind == oa.CHAT else "completions"
        t0 = time.perf_counter()
        check_key(request)
        try:
            p = await asyncio.to_thread(parse, await read_body(request), kind)
        except oa.ApiError:
            metrics.requests.labels(endpoint, "rejected").inc()
            raise
        if p.model is not None and p.model not in model_ids:
            metrics.requests.labels(endpoint, "rejected").inc()
            raise oa.ApiError(404, f"The model {p.model!r} does not exist: this server serves {model_id!r} (leave "
                              f"'model' out, or send that id)", param="model", code="model_not_found")
        new = [k for k in p.ignored if (kind, k) not in logged_unknown]
        if new:
            logged_unknown.update((kind, k) for k in new)
            log.warning("%s: ignoring unknown field(s) %s (logged once per field)", request.url.path,
                        ", ".join(map(repr, new)))
        rid = ("chatcmpl-" if kind == oa.CHAT else "cmpl-") + uuid.uuid4().hex[:24]
        aloop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = Request(p.prompt_ids, p.max_tokens, p.sampling, stop_ids=tuple(eos_ids),
                      stop=stop_strings(tokenizer, p.stop), rid=rid, text=p.prompt_text)
        state = {"streamed": 0, "first": None}

        def count(ev: StreamEvent) -> None:
            """Metrics of an event (on the loop's thread: counted even when the client has gone)."""
            if ev.tokens and state["first"] is None:
                state["first"] = time.perf_counter()
                metrics.ttft.observe(state["first"] - t0)
            n = len(ev.result.tokens) - state["streamed"] if ev.final else len(ev.tokens)
            state["streamed"] += n  # the final event also counts an EOS, which is not streamed
            metrics.generated_tokens.inc(n)
            if ev.final:
                outcome = oa.finish_reason(ev.result.stop_reason) or ev.result.stop_reason.split(":")[0]
                metrics.requests.labels(endpoint, outcome).inc()
                metrics.latency.observe(time.perf_counter() - t0)

        def on_event(ev: StreamEvent) -> None:
            count(ev)
            aloop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            loop.submit(req, on_event=on_event)
        except QueueFull as e:
            metrics.requests.labels(endpoint, "rejected").inc()
            raise oa.ApiError(429, str(e), code="rate_limit_exceeded",
                              headers={"Retry-After": str(max(1, round(e.retry_after)))}) from None
        except LoopClosed as e:
            metrics.requests.labels(endpoint, "rejected").inc()
            raise oa.ApiError(503, str(e)) from None
        metrics.prompt_tokens.inc(len(p.prompt_ids))
        out = oa.Response(kind, rid, model_id, return_token_ids=p.return_token_ids)
        text = oa.TextStream(tokenizer, p.stop)

        async def next_event(watch) -> StreamEvent | None:
            """The next event, or None when the client went away first (the request is then cancelled)."""
            get = asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                return get.result()
            get.cancel()
            loop.cancel(rid)
            return None

        watch = asyncio.ensure_future(_disconnected(request))
        try:
            first = await next_event(watch)
            if first is None:
                return Response(status_code=499)
            if first.final and not first.tokens:
                err = oa.error_of(first.result.stop_reason, kind)
                if err is not None:
                    return error(err)
            if not p.stream:
                ev = first
                parts = [text.feed(ev.tokens)]
                while not ev.final:
                    ev = await next_event(watch)
                    if ev is None:
                        return Response(status_code=499)
                    parts.append(text.feed(ev.tokens))
                res = ev.result
                err = oa.error_of(res.stop_reason, kind)
                if err is not None:
                    return error(err)
                parts.append(text.finish())
                return out.full("".join(parts), oa.finish_reason(res.stop_reason), len(p.prompt_ids), res.tokens)
        finally:
            watch.cancel()

        async def sse():
            ev, done, n_ids = first, False, 0
            try:
                if kind == oa.CHAT:
                    yield _sse(out.chunk("", role=True, include_usage=p.include_usage))
                while True:
                    delta = text.feed(ev.tokens)
                    if (delta or (ev.tokens and p.return_token_ids)) and not ev.final:
                        n_ids += len(ev.tokens)
                        yield _sse(out.chunk(delta, token_ids=list(ev.tokens), include_usage=p.include_usage))
                    if ev.final:
                        break
                    ev = await events.get()
                done = True
                res = ev.result
                err = oa.error_of(res.stop_reason, kind)
                if err is not None:
                    yield _sse(err.body())
                else:
                    rest = delta + text.finish()  # the final chunk: its text, the finish reason, the ids left (EOS)
                    yield _sse(out.chunk(rest if (rest or kind == oa.COMPLETION) else None,
                                         finish=oa.finish_reason(res.stop_reason), token_ids=res.tokens[n_ids:],
                                         include_usage=p.include_usage))
                    if p.include_usage:
                        yield _sse(out.usage_chunk(len(p.prompt_ids), len(res.tokens)))
                yield "data: [DONE]\n\n"
            finally:
                if not done:  # the client went away mid-stream: free the slot at the next window boundary
                    loop.cancel(rid)

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await complete(request, oa.CHAT)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await complete(request, oa.COMPLETION)

    return app
