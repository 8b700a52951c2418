"""The scheduler as a service: a `BatchScheduler` stepped by its own thread and fed from any thread.

`EngineLoop.submit(request) -> RequestStream` queues a request (thread-safe) and returns its stream: the token ids
as the windows emit them, then the `RequestResult`. `EngineLoop.cancel(rid)` ends a request at the next window
boundary (its slot is free for the next admission). Requests are admitted into free slots as they arrive
(continuous batching): between two scheduler steps the loop hands the new requests and cancellations to the
scheduler, and it steps while anything is queued, decoding or in flight; idle, it sleeps until a submission.

Every engine call happens on the loop's thread, so nothing else touches JAX state. The stream's events are
`StreamEvent` objects: after each step, one event per request with the tokens that step emitted; the last event
carries the result (and any tokens of the final step). A caller either iterates the stream (a thread-safe queue) or
passes ``on_event``, called on the loop's thread (an asyncio server hands the events to its event loop there).

A bounded queue (``max_queue``) refuses a request that would have to wait behind ``max_queue`` others for a slot
(`QueueFull`); `EngineLoop.close` stops accepting requests and, with ``drain``, lets the queued and running ones
finish before the thread ends.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable

from strata_jax.errors import StrataError
from strata_jax.pipeline.scheduler import BatchScheduler, Request, RequestResult

log = logging.getLogger("strata_jax")


class QueueFull(StrataError):
    """The request would wait behind ``max_queue`` others (HTTP 429); ``retry_after`` in seconds."""

    def __init__(self, msg: str, retry_after: float = 1.0):
        super().__init__(msg)
        self.retry_after = float(retry_after)


class LoopClosed(StrataError):
    """The loop no longer accepts requests (shutting down, or stopped by an error)."""


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """Tokens emitted by one scheduler step (``tokens``, ids, possibly empty on the final event); ``result`` is the
    `RequestResult` on the final event, else None."""

    tokens: tuple
    result: RequestResult | None = None

    @property
    def final(self) -> bool:
        return self.result is not None


class RequestStream:
    """The events of one submitted request (see the module doc). Iterate it for `StreamEvent` objects (ends after the
    final one), or `wait` for the result."""

    def __init__(self, rid, on_event: Callable[[StreamEvent], None] | None = None):
        self.rid = rid
        self.result: RequestResult | None = None
        self._on_event = on_event
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._pending: list[int] = []       # loop thread only: tokens of the current step
        self._final: RequestResult | None = None

    def _push(self, ev: StreamEvent) -> None:
        if ev.result is not None:
            self.result = ev.result
        if self._on_event is not None:
            try:
                self._on_event(ev)
            except Exception:
                log.exception("on_event of request %r raised", self.rid)
        else:
            self._q.put(ev)
        if ev.result is not None:
            self._done.set()

    def __iter__(self):
        if self._on_event is not None:
            raise TypeError("this stream delivers its events to on_event")
        while True:
            ev = self._q.get()
            yield ev
            if ev.final:
                return

    def wait(self, timeout: float | None = None) -> RequestResult | None:
        """The result once the request has ended (None if ``timeout`` seconds pass first)."""
        self._done.wait(timeout)
        return self.result


class EngineLoop:
    """A thread that steps a `BatchScheduler` (see the module doc).

    Args:
      scheduler: the scheduler (its engine is used only from the loop's thread from now on).
      max_queue: most requests waiting for a slot (None: unbounded); one more raises `QueueFull`.
      on_step: called on the loop's thread with the seconds of each scheduler step (metrics).
      retry_after: seconds suggested to a refused client (`QueueFull.retry_after`).
    """

    def __init__(self, scheduler: BatchScheduler, *, max_queue: int | None = None,
                 on_step: Callable[[float], None] | None = None, retry_after: float = 1.0):
        if max_queue is not None and max_queue < 0:
            raise StrataError(f"--max_queue {max_queue}: must be >= 0")
        self.sch = scheduler
        self.max_queue = max_queue
        self.on_step = on_step
        self.retry_after = float(retry_after)
        self._cv = threading.Condition()
        self._inbox: list[Request] = []
        self._cancels: list = []
        self._streams: dict[Any, RequestStream] = {}   # live requests (submitted, not finished)
        self._touched: dict[Any, RequestStream] = {}   # loop thread: streams with events of the current step
        self._closing = False
        self._drain = True
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.steps = 0

    # ---- state (readable from any thread) ---------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.sch.engine.n_slots

    @property
    def running(self) -> int:
        """Requests holding a slot: in prefill (read on the loop's thread) or decoding."""
        return min(self.n_slots, len(self.sch.active) + len(self.sch.admitting))

    @property
    def queue_depth(self) -> int:
        """Requests submitted and not yet admitted into a slot."""
        return len(self._inbox) + len(self.sch.queue)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- control ----------------------------------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="strata-engine-loop", daemon=True)
            self._thread.start()
        return self

    def submit(self, req: Request, on_event: Callable[[StreamEvent], None] | None = None) -> RequestStream:
        """Queue ``req`` (any thread); returns its `RequestStream`. ``req.rid`` None gets a fresh id. The request's
        ``on_token`` / ``on_finish`` are taken over by the stream.

        Raises:
          QueueFull: ``max_queue`` requests already wait for a slot.
          LoopClosed: the loop is shutting down or has stopped.
          StrataError: an id already in use, or an empty prompt.
        """
        if not req.prompt_ids:
            raise StrataError("empty prompt")
        with self._cv:
            if self._closing or self.error is not None or self._thread is None:
                raise LoopClosed("the engine is shutting down" if self._closing else
                                 f"the engine loop has stopped ({self.error!r})" if self.error is not None else
                                 "the engine loop is not started")
            if self.max_queue is not None:
                free = max(0, self.n_slots - self.running)
                if self.queue_depth >= free + self.max_queue:
                    waits = " already waits" if self.queue_depth == 1 else "s already wait"
                    raise QueueFull(f"the server is busy: {self.queue_depth} request{waits} for its {self.n_slots} "
                                    f"slot{'' if self.n_slots == 1 else 's'} (--max_queue {self.max_queue}); retry "
                                    f"later", self.retry_after)
            if req.rid is None:
                req.rid = f"req-{next(self._ids)}"
            if req.rid in self._streams:
                raise StrataError(f"request id {req.rid!r} is already in use")
            stream = RequestStream(req.rid, on_event)
            req.on_token = lambda t, s=stream: self._on_token(s, t)
            req.on_finish = lambda r, s=stream: self._on_finish(s, r)
            self._streams[req.rid] = stream
            self._inbox.append(req)
            self._cv.notify()
        return stream

    def submit_all(self, reqs) -> list[RequestStream]:
        """`submit` each of ``reqs`` under one hold of the lock: the loop's thread takes them into the scheduler in
        the same step."""
        with self._cv:  # a Condition's default lock is reentrant: `submit` takes it again
            return [self.submit(r) for r in reqs]

    def cancel(self, rid) -> None:
        """End request ``rid`` (any thread): dropped if queued, its slot freed at the next window boundary if
        decoding; a no-op for a finished or unknown id."""
        with self._cv:
            if rid in self._streams:
                self._cancels.append(rid)
                self._cv.notify()

    def close(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Stop accepting requests; with ``drain`` let the queued and running ones finish, else cancel them; wait
        up to ``timeout`` seconds for the thread. Returns True when the thread has ended."""
        with self._cv:
            self._closing = True
            self._drain = self._drain and drain
            self._cv.notify()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the loop's thread ------------------------------------------------------------------------------------------
    def _on_token(self, stream: RequestStream, tok: int) -> None:
        stream._pending.append(int(tok))
        self._touched[stream.rid] = stream

    def _on_finish(self, stream: RequestStream, res: RequestResult) -> None:
        stream._final = res
        self._touched[stream.rid] = stream

    def _flush(self) -> None:
        """One event per request the last step touched; finished requests leave the scheduler and the loop."""
        touched, self._touched = self._touched, {}
        for rid, s in touched.items():
            toks, s._pending = tuple(s._pending), []
            if s._final is not None:
                with self._cv:
                    self._streams.pop(rid, None)
                self.sch.pop_result(rid)
                s._push(StreamEvent(toks, s._final))
            elif toks:
                s._push(StreamEvent(toks))

    def _main(self) -> None:
        sch = self.sch
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._cancels or sch.busy or self._closing):
                        self._cv.wait()
                    new, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, []
                    if self._closing and not self._drain:
                        cancels = list(self._streams)
                    if self._closing and not new and not sch.busy:
                        break
                for req in new:
                    try:
                        sch.submit(req)
                    except StrataError as e:
                        res = RequestResult(req.rid, prompt_tokens=len(req.prompt_ids))
                        res.stop_reason = f"refused: {e}"
                        self._on_finish(self._streams[req.rid], res)
                for rid in cancels:
                    if rid in sch.results:
                        sch.cancel(rid)
                if sch.busy:
                    t = time.perf_counter()
                    sch.step()
                    self.steps += 1
                    if self.on_step is not None:
                        self.on_step(time.perf_counter() - t)
                self._flush()
        except BaseException as e:  # a scheduler bug: every live request ends with it, the loop stops
            log.exception("the engine loop stopped")
            self.error = e
            self._flush()
            with self._cv:
                live, self._streams = dict(self._streams), {}
            for rid, s in live.items():
                res = sch.results.get(rid) or RequestResult(rid)
                res.stop_reason = res.stop_reason or f"error: the engine loop stopped ({type(e).__name__}: {e})"
                s._push(StreamEvent(tuple(s._pending), res))
