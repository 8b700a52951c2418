"""strata-serve: an OpenAI-compatible HTTP server over the batch slots.

Examples:
  strata-serve                                   (the default model, one slot: listens on http://127.0.0.1:8000)
  strata-serve --model qwen2.5-coder-0.5b --batch 4                 (4 requests decode together)
  curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}'
  strata-serve --model ./model.gguf --layer_split 24 --batch 4 --piped_mtp 3 --host 0.0.0.0 --api_key "$KEY"

Routes: POST /v1/chat/completions, POST /v1/completions (streaming with "stream": true), GET /v1/models (and
/v1/models/ID), GET /health, GET /metrics (Prometheus). Requests are admitted into free slots as they arrive
(continuous batching; the batch mode comes from the same flags as strata-generate's: --batch, --batch_groups,
--batch_mtp, --piped_mtp, and a request alone decodes on the solo path with --draft's proposals up to --spec). A
greedy or seeded request gets exactly the tokens strata-generate gives for the same prompt and settings, whatever
runs beside it; sampling fields a request leaves out take the flags' values (--temperature, --top_k, --top_p,
--min_p, --seed, --max_new_tokens); without --seed, a sampled request that gives no seed draws a fresh one. The
model must carry a usable tokenizer (checked from the file's header before the weights load). Bad requests get a 400
with an OpenAI-style error naming the field; a body over --max_request_mb a 413; a full queue (--max_queue) a 429
with Retry-After. SIGTERM (or Ctrl-C) stops accepting connections, lets the running requests finish, and exits; a
second one exits at once. Before it listens (loading, warming up) either exits at once (status 130 / 143).
"""

from __future__ import annotations

import os
import socket
import time

from absl import flags

from strata_jax.cli import flags as shared
from strata_jax.cli.flags import FLAGS, fail

flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (default: loopback only; 0.0.0.0 for every interface).")
flags.DEFINE_integer("port", 8000, "TCP port to listen on (0: a free port, printed at start).", lower_bound=0,
                     upper_bound=65535)
flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer KEY' on the /v1 routes (401 without it). "
                    "Default: $STRATA_API_KEY if set, else open.")
flags.DEFINE_integer("max_queue", 64, "Most requests waiting for a free slot; one more gets 429 with Retry-After.",
                     lower_bound=0)
flags.DEFINE_float("max_request_mb", 8.0, "Largest request body in MiB; a larger one gets 413 before it is read "
                   "whole (8 MiB holds a prompt of about a million tokens).", lower_bound=0.001)
flags.DEFINE_string("model_name", None, "The model id /v1/models lists and answers name (default: the --model "
                    "name, without .gguf).")
flags.DEFINE_bool("warmup", True, "Before listening, decode one short request alone, then --batch at once, so the "
                  "first requests do not wait for the prefill and window compiles (nor for the programs of "
                  "several steps, --decode_steps: these compile in background threads beside the others; "
                  "STRATA_COMPILE_AHEAD=0 compiles them one after another).")
flags.DEFINE_bool("warmup_sampled", True, "With --warmup, decode the same rounds again with sampled requests "
                  "(temperature > 0): greedy and sampled rows run different programs (a window with any sampled row "
                  "runs the sampled one), so without this the first sampled request compiles its own. "
                  "--nowarmup_sampled shortens the warm-up of a server whose clients decode greedily.")


def _draining_server_class():
    import contextlib
    import signal

    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, whose SIGTERM / SIGINT handler starts the graceful shutdown (stop accepting, let the
        open requests finish) and, unlike uvicorn's own, does not raise the signal again afterwards: the command
        then exits with status 0. A second SIGINT / SIGTERM exits at once (status 128 + the signal), without the
        open requests: uvicorn's own second Ctrl-C cancelled the handlers and then still waited for the engine to
        finish every request, logging a traceback per token."""

        def handle_exit(self, sig, frame):
            if self.should_exit:
                shared.exit_now(128 + sig, f"strata-serve: {signal.Signals(sig).name} again: exiting without "
                                           "finishing the open requests")
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    return DrainingServer


def _exit_on_signal(sig, frame) -> None:
    """SIGINT / SIGTERM while nothing is served (the model loading, the warm-up, the last drain): leave at once
    with status 128 + the signal. Python's own Ctrl-C was lost when its KeyboardInterrupt landed in one of JAX's
    gc callbacks (the server then loaded and served), and SIGTERM ended the process without a word."""
    import signal

    shared.exit_now(128 + sig, "interrupted" if sig == signal.SIGINT else "terminated")


def _model_id() -> str:
    if FLAGS.model_name:
        return FLAGS.model_name
    name = os.path.basename(FLAGS.model)
    return name[:-5] if name.endswith(".gguf") else name


def _bind() -> socket.socket:
    """The listening socket (bound here, so that a busy port is one error line before the model loads)."""
    try:
        infos = socket.getaddrinfo(FLAGS.host, FLAGS.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        fail(f"--host {FLAGS.host}: {e.strerror}")
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        fail(f"--host {FLAGS.host} --port {FLAGS.port}: cannot listen there ({e.strerror})")
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _warmup_rounds(sch) -> list[tuple[int, int]]:
    """The warm-up's rounds: (requests at once, tokens each): one request alone, then with ``--batch`` > 1 every
    slot at once. 3 tokens each; with `BatchScheduler.decode_steps` N > 1, enough for one program of N steps and a
    single step after it: N + 2 alone, N + n + 1 for n at once (the first prompt read decodes one token while
    each of the n - 1 others is read)."""
    n, N = sch.engine.n_slots, sch.decode_steps
    return [(k, 3 if N == 1 else N + k + 1) for k in [1] + ([n] if n > 1 else [])]


WARMUP_SAMPLED = dict(temperature=1.0, top_k=40, seed=1)   # the sampled rounds' requests


def _warmup(loop, engine, tokenizer, sampled: bool = True) -> list:
    """`_warmup_rounds` on ``loop`` before the first client's request: the prefill and the solo path's decode
    shapes (a lone request's), then the batch window shapes, each with its program of several decode steps when
    the scheduler runs them; the requests of a round reach the scheduler together. With ``sampled`` the rounds run
    again with sampled requests (`WARMUP_SAMPLED`): whether every row is greedy is part of each program
    (`RowSampling.all_greedy`), so greedy rounds leave a sampled request's programs uncompiled.

    Before the rounds, those programs of several steps (for one row and for a row per slot:
    `BatchScheduler.step_program_rows`) start compiling in background threads
    (`BatchScheduler.compile_steps_ahead`; not with ``STRATA_COMPILE_AHEAD=0``, `compile_ahead_enabled`), for
    greedy rows as the warm-up's are: they compile beside the rounds' prefill, step and window programs instead of
    one after another at their first calls (on a GPU a cold compile of the 48-layer model's program takes 40-70 s;
    XLA releases the GIL while it compiles). Nothing is submitted yet, so the loop's thread is idle while the
    engine is read here. Returns the compile cache keys whose compile it started."""
    from strata_jax.pipeline.scheduler import Request
    from strata_jax.pipeline.solo import compile_ahead_enabled
    from strata_jax.sampling import SamplingParams

    greedy = SamplingParams(0.0)
    ahead = loop.sch.compile_steps_ahead(greedy) if compile_ahead_enabled() else []
    rounds = _warmup_rounds(loop.sch)
    most = max(k for _, k in rounds)
    ids = list(tokenizer.encode("Hello"))[: max(1, engine.max_context - 1 - most)] or [0]
    kinds = [("", greedy)] + ([("sampled-", SamplingParams(**WARMUP_SAMPLED))] if sampled else [])
    # the rounds' reads at a chunk before every window (the loop is idle between rounds): with a smaller
    # --batch_read_share the first requests would end before the last prompts are read, and the windows of every
    # slot at once would compile at a client's first burst instead
    share, loop.sch.read_share = loop.sch.read_share, 1.0
    try:
        for name, params in kinds:
            for r, (n, k) in enumerate(rounds):
                for s in loop.submit_all([Request(ids, k, params, rid=f"warmup-{name}{r}-{i}") for i in range(n)]):
                    s.wait()
    finally:
        loop.sch.read_share = share
    return ahead


def main(argv) -> int:
    shared.quiet_logs()
    import logging

    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("strata_jax.serve").setLevel(logging.INFO)
    extra = list(argv[1:])
    if extra:
        fail(f"unexpected argument{'s' if len(extra) > 1 else ''} {' '.join(repr(a) for a in extra)}: each flag "
             f"takes one value")
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):   # uvicorn installs its own while it serves, and restores these
        signal.signal(sig, _exit_on_signal)
    shared.check_spec_flag()
    shared.check_shared_flags(batch=True)
    from strata_jax.pipeline.solo import compile_ahead_enabled

    compile_ahead_enabled()   # a bad STRATA_COMPILE_AHEAD is one error line before the model loads (the warm-up's)
    from strata_jax.cli.openai_api import MAX_TEMPERATURE

    if not 0.0 <= FLAGS.temperature <= MAX_TEMPERATURE:  # the default of requests: the range a request may ask for
        fail(f"--temperature {FLAGS.temperature}: strata-serve's default temperature must lie in [0, 2] (0 is greedy), "
             "the range a request may ask for")
    api_key = FLAGS.api_key if FLAGS.api_key is not None else os.environ.get("STRATA_API_KEY")
    if api_key is not None and not api_key.strip():
        fail("--api_key: empty key (leave the flag out for an open server)")
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        fail(f"strata-serve needs the 'serve' extra ({', '.join(missing)} missing): pip install -e '.[serve]'")
    import uvicorn
    sock = _bind()
    tok = shared.header_tokenizer("strata-serve")  # chat and text prompts need it: checked before any weights load
    engine = shared.load_engine()
    from strata_jax.cli import openai_api as oa
    from strata_jax.cli.server import Metrics, create_app
    from strata_jax.pipeline.loop import EngineLoop
    if tok.chat_template_source != "gguf":
        shared.CONSOLE.note(f"warning: this file has no chat template; /v1/chat/completions uses a generic one "
                            f"({tok.chat_template_source}), which a base model may not follow")
    metrics = Metrics()
    sch, res, _ = shared.batch_scheduler(engine, solo_spec=True, on_window=metrics.on_window)
    caches = [engine.cache]
    d_eng = getattr(getattr(sch.proposer_factory, "__self__", None), "engine", None)  # --draft model's engine
    if d_eng is not None and d_eng is not engine:
        caches.append(d_eng.cache)
    metrics.watch_compiles(caches, shared.XLA_CACHE)
    loop = EngineLoop(sch, max_queue=FLAGS.max_queue, on_step=metrics.on_step).start()
    if FLAGS.warmup:
        what = ", then ".join(f"{'1 request' if n == 1 else f'{n} at once'} of {k} tokens"
                              for n, k in _warmup_rounds(sch))
        what += ", greedy then sampled" if FLAGS.warmup_sampled else ", greedy"
        shared.CONSOLE.note(f"warming up: {what} ...")
        t0 = time.perf_counter()
        _warmup(loop, engine, tok, sampled=FLAGS.warmup_sampled)
        shared.CONSOLE.note(f"warmed up in {time.perf_counter() - t0:.1f} s: {shared.compile_summary(caches)}")
    app = create_app(loop, tok, model_id=_model_id(), max_context=engine.max_context,
                     vocab_size=engine.cfg.vocab_size,
                     defaults=oa.Defaults(FLAGS.max_new_tokens, shared.default_sampling(),
                                          fresh_seeds=not FLAGS["seed"].present), eos_ids=tok.eos_ids,
                     api_key=api_key, metrics=metrics, on_shutdown=lambda: loop.close(drain=True),
                     max_request_bytes=int(FLAGS.max_request_mb * (1 << 20)))
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    shared.CONSOLE.note(f"strata-serve: {_model_id()} ({res.mode}, {engine.n_slots} slot(s)) on http://{shown}:{port}"
                        f"{' (API key required)' if api_key else ''}")
    config = uvicorn.Config(app, log_level="info" if FLAGS.verbose else "warning", timeout_graceful_shutdown=None,
                            access_log=bool(FLAGS.verbose))
    server = _draining_server_class()(config)
    server.run(sockets=[sock])  # SIGTERM / SIGINT: stop accepting, finish the open requests, then shut the app down
    loop.close(drain=True)
    shared.CONSOLE.note(f"strata-serve: stopped ({shared.compile_summary(caches)})")
    return 0


def run() -> None:
    """Console entry point (``strata-serve``)."""
    shared.run_command(main, "strata_jax.cli.serve", __doc__)


if __name__ == "__main__":
    run()
