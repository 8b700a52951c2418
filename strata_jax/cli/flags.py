"""The flags both commands take (``strata-generate`` and ``strata-serve``): the model and how it is loaded, the
request defaults, proposals and batch slots; the checks they need before a model is loaded; and the steps both
commands run with them (the compilation cache, loading the engine, resolving the batch mode, the proposer factory,
the scheduler, one ``error:`` line and exit status 2 for bad input).

Defined once, at import: a command imports this module and defines only its own flags beside them.
"""

from __future__ import annotations

import math
import os
import sys

from absl import flags

from strata_jax.errors import StrataError

FLAGS = flags.FLAGS

# ---- the model and how it is held ------------------------------------------------------------------------------------
flags.DEFINE_string("model", "smollm2-135m", "A registry name (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
                    "gemma3-270m) or a path to a .gguf file.")
flags.DEFINE_string("cache_dir", None, "Where named models are cached (default $STRATA_JAX_CACHE or "
                    "~/.cache/strata_jax).")
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
flags.DEFINE_bool("verbose", False, "Log compiles and show tracebacks.")

# ---- request defaults (strata-serve: for requests that leave the field out) -----------------------------------------
flags.DEFINE_integer("max_new_tokens", 256, "Most tokens to generate (strata-serve: the default max_tokens).",
                     lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; <= 0 is greedy.")
flags.DEFINE_integer("top_k", 40, "Keep the k most likely tokens (1..64; 0 = 64).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the smallest set with this much probability.")
flags.DEFINE_float("min_p", 0.0, "Keep tokens with p >= min_p * p_max.")
flags.DEFINE_integer("seed", 0, "Sampling seed, 0..2**32-1; draws are keyed by (seed, position).")

# ---- proposals and batch slots ---------------------------------------------------------------------------------------
flags.DEFINE_enum("draft", "none", ["none", "lookup", "model", "mtp"], "Speculative decoding proposals: none, "
                  "lookup (prompt lookup / suffix match), model (--draft_model drafts greedily), mtp (the model's MTP "
                  "layer). The output is the same as without.")
flags.DEFINE_string("draft_model", None, "With --draft model: a registry name or .gguf path with the same tokenizer.")
flags.DEFINE_integer("spec", 4, "Speculative window cap T (2..8): the last token + up to T-1 proposals "
                     "(strata-generate: one prompt only, with --prompts_file use --batch_mtp or --piped_mtp; "
                     "strata-serve: the window cap of a request that decodes alone, with --draft).")
flags.DEFINE_float("spec_min_p", 0.0, "Cut proposals at the first one below this proposer probability, in [0, 1] "
                   "(0 = off).")
flags.DEFINE_integer("batch", 1, "Batch slots: requests decode together (strata-generate: needs --prompts_file when "
                     "> 1; strata-serve: concurrent requests, the others wait in the queue).", lower_bound=1)
flags.DEFINE_string("batch_groups", "auto", "Slot groups on a layer split: 1 (serial windows), G (pipelined groups; "
                    "G divides --batch) or auto (one group per stage).")
flags.DEFINE_bool("batch_mtp", False, "Batch proposals: each slot's token + 1 proposal per serial window.")
flags.DEFINE_integer("piped_mtp", 0, "Proposals per window in pipelined groups of one slot, 0..7 (0 = off).")
flags.DEFINE_float("memory_limit_gib", None, "Device memory per stage for the batch-fit check (default: the "
                   "device's own limit where known).")


def fail(msg: str) -> None:
    """Raise the `StrataError` that becomes the command's ``error:`` line (exit status 2)."""
    raise StrataError(msg)


def flag_label(key: str) -> str:
    return "--" + key


def check_model_arg(flag: str, spec: str) -> None:
    """A model flag names an existing file or a registry name (checked without fetching anything)."""
    from strata_jax.models_registry import registry

    if spec.endswith(".gguf") or os.sep in spec or os.path.exists(spec):
        if not os.path.exists(spec):
            fail(f"--{flag} {spec}: no such file")
    elif spec not in registry():
        fail(f"--{flag}: unknown model {spec!r}; known models: {', '.join(sorted(registry()))} (or pass a path to a "
             f".gguf file)")


def n_stages() -> int:
    """Stages the ``--layer_split`` gives (1 without one)."""
    return 1 + len([p for p in (FLAGS.layer_split or "").split(",") if p.strip()])


def check_shared_flags(*, batch: bool) -> None:
    """The checks of the shared flags that need no model (run before anything is loaded or downloaded): request
    defaults by `strata_jax.cli.requests.check_request_values`, ``--spec_min_p``, ``--xla_cache_dir`` (created, ``~``
    expanded), ``--draft`` / ``--draft_model``, and with ``batch`` the group flags (`resolve_groups`).

    Raises:
      StrataError: the first bad value.
    """
    from strata_jax.cli.requests import check_request_values
    from strata_jax.pipeline.groups import resolve_groups

    check_request_values({"max_new_tokens": FLAGS.max_new_tokens, "temperature": FLAGS.temperature,
                          "top_k": FLAGS.top_k, "top_p": FLAGS.top_p, "min_p": FLAGS.min_p, "seed": FLAGS.seed},
                         flag_label)
    if not (math.isfinite(FLAGS.spec_min_p) and 0.0 <= FLAGS.spec_min_p <= 1.0):
        fail(f"--spec_min_p {FLAGS.spec_min_p}: must lie in [0, 1] (0 = off)")
    if FLAGS.xla_cache_dir:
        FLAGS.xla_cache_dir = os.path.expanduser(FLAGS.xla_cache_dir)
        try:
            os.makedirs(FLAGS.xla_cache_dir, exist_ok=True)
            if not os.access(FLAGS.xla_cache_dir, os.W_OK):
                raise PermissionError(13, "not writable")
        except OSError as e:
            fail(f"--xla_cache_dir {FLAGS.xla_cache_dir}: cannot use it as the compilation cache "
                 f"({e.strerror}); give another folder, or '' to turn the cache off")
    if FLAGS.draft_model is not None and FLAGS.draft != "model":
        fail("--draft_model needs --draft model")
    if FLAGS.draft == "model":
        if not FLAGS.draft_model:
            fail("--draft model needs --draft_model NAME_OR_PATH (a smaller GGUF with the same tokenizer)")
        check_model_arg("draft_model", FLAGS.draft_model)
    if batch:
        resolve_groups(FLAGS.batch, n_stages(), FLAGS.batch_groups, FLAGS["batch_groups"].present > 0,
                       FLAGS.batch_mtp, FLAGS.piped_mtp)  # impossible group flags: before the model is loaded


def check_spec_flag() -> None:
    """``--spec`` lies in 2..8 when proposals are asked for (``--draft`` not none)."""
    from strata_jax.pipeline.stages import MAX_WINDOW

    if FLAGS.draft != "none" and not 2 <= FLAGS.spec <= MAX_WINDOW:
        fail(f"--spec {FLAGS.spec}: the window cap must lie in 2..{MAX_WINDOW}")


def default_sampling():
    """The request defaults of the sampling flags."""
    from strata_jax.sampling import SamplingParams

    return SamplingParams(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.min_p, FLAGS.seed)


def load_engine():
    """Fetch ``--model`` (registry names: into the cache on first use), turn on ``--xla_cache_dir``, and load the
    `Engine` with the engine flags (progress on stderr); warns when ``--max_context`` passes the trained context.

    Raises:
      StrataError: unknown model, bad file, unsupported architecture or block format, bad split.
    """
    import jax.numpy as jnp

    from strata_jax.models_registry import resolve_model
    from strata_jax.pipeline.engine import Engine

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
    return engine


def proposer_factory_for(engine, draft: str, n_props: int = 1, draft_model: str | None = None, cache_dir=None):
    """``() -> Proposer`` for batch proposals (up to ``n_props`` per window): ``--draft lookup`` / ``mtp`` / ``model``
    as asked; ``none`` picks MTP when the model has an MTP layer, else prompt lookup. Returns (factory, name).

    Raises:
      StrataError: ``--draft mtp`` on a model without an MTP layer; ``model`` without ``--draft_model``.
    """
    from strata_jax.proposers import LookupProposer, make_proposer

    n_props = max(1, int(n_props))
    if draft == "none":
        draft = "mtp" if int(getattr(engine.cfg, "n_nextn", 0) or 0) > 0 else "lookup"
    if draft == "lookup":
        return LookupProposer, "lookup"
    if draft == "mtp":
        make_proposer("mtp", engine, spec=n_props + 1)  # loads the MTP layer once; raises when the model has none
        return (lambda: make_proposer("mtp", engine, spec=n_props + 1)), "mtp"
    if draft == "model":
        shared = make_proposer("model", engine, draft_model=draft_model, spec=n_props + 1, cache_dir=cache_dir)
        if shared.engine.n_slots != engine.n_slots:
            shared.engine.set_slots(engine.n_slots)  # request in target slot s drafts in draft slot s
        return shared.fork, "model"
    raise StrataError(f"--draft {draft}: expected one of none, lookup, mtp, model")


def batch_scheduler(engine, *, solo_spec: bool = False, **kwargs):
    """The `BatchScheduler` of the batch flags on ``engine``: memory report (stderr), fit check of ``--batch``
    slots, group resolution (one ``batch:`` line on stderr), the slots, the proposer factory. With ``solo_spec``
    (the server) a request decoding alone also gets ``--draft``'s proposals up to ``--spec`` (with the solo path's
    policy). ``kwargs`` go to the scheduler. Returns (scheduler, resolution, proposer name or None).

    Raises:
      StrataError: the slots do not fit, impossible group flags, proposals the model cannot give.
    """
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.memory import check_batch_fits, memory_lines
    from strata_jax.pipeline.scheduler import BatchScheduler

    for line in memory_lines(engine):
        print(line, file=sys.stderr)
    limit = int(FLAGS.memory_limit_gib * 2 ** 30) if FLAGS.memory_limit_gib else None
    check_batch_fits(engine, FLAGS.batch, limit)
    res = resolve_groups(FLAGS.batch, len(engine.stages), FLAGS.batch_groups, FLAGS["batch_groups"].present > 0,
                         FLAGS.batch_mtp, FLAGS.piped_mtp)
    if engine.n_slots != FLAGS.batch:
        engine.set_slots(FLAGS.batch)
    spec = FLAGS.spec if solo_spec and FLAGS.draft != "none" else 0
    wants = res.mode in ("batch_mtp", "piped_mtp") or spec
    n_props = max(res.piped_mtp, spec - 1, 1)
    factory, pname = (proposer_factory_for(engine, FLAGS.draft, n_props, FLAGS.draft_model, FLAGS.cache_dir)
                      if wants else (None, None))
    extra = f"; proposals: {pname}" if res.mode in ("batch_mtp", "piped_mtp") else ""
    if spec:
        extra += f"; a request alone: {pname} proposals, window cap {spec}"
    print(f"batch: {res.message}{extra}", file=sys.stderr)
    sch = BatchScheduler(engine, res, proposer_factory=factory, spec_min_p=FLAGS.spec_min_p, solo_spec=spec,
                         spec_policy=bool(spec), **kwargs)
    return sch, res, pname


# ---- running a command -----------------------------------------------------------------------------------------------
def exit_broken_pipe() -> None:
    """The reader of stdout went away (e.g. ``| head``): stop quietly. stdout goes to /dev/null so that the
    interpreter's final flush does not complain again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    sys.exit(141)  # 128 + SIGPIPE, as a program killed by the broken pipe


def run_command(main, module_name: str, doc: str) -> None:
    """Run a command's ``main(argv) -> status`` under absl: bad flags and `StrataError` print one ``error:`` line
    and exit with status 2 (``--verbose`` shows the traceback), ``--help`` lists the command's flags and these,
    a broken pipe exits quietly, Ctrl-C exits with 130.

    Args:
      main: the command's main function.
      module_name: the command's module (``strata_jax.cli.generate``); its flags are listed first by ``--help``.
      doc: the command's usage text (printed by ``--help`` before the flags).
    """
    from absl import app

    def parse(argv):
        # absl lists only __main__'s flags, which for a console script is pip's wrapper: list both modules here
        if any(a in ("-h", "--help", "--helpshort") for a in argv[1:]):
            mod = sys.modules.get(module_name) or sys.modules["__main__"]
            text = FLAGS.module_help(mod)
            if text.lstrip().startswith("__main__:"):  # run as `python -m <module>`
                text = text.replace("__main__:", module_name + ":", 1)
            text += "\n\n" + FLAGS.module_help(sys.modules[__name__])
            try:
                print(doc)
                print(text)
                sys.stdout.flush()
            except BrokenPipeError:
                exit_broken_pipe()
            sys.exit(0)
        try:
            return FLAGS(argv)
        except flags.Error as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    def guarded(argv):
        try:
            sys.exit(main(argv))
        except StrataError as e:
            if FLAGS.verbose:
                raise
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except BrokenPipeError:
            exit_broken_pipe()
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            sys.exit(130)

    app.run(guarded, flags_parser=parse)


def quiet_logs() -> None:
    """absl logs at INFO by default (JAX's backend probing included): keep the output to text + stats unless
    ``--verbose``."""
    import logging

    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.INFO if FLAGS.verbose else absl_logging.WARNING)
    logging.getLogger("strata_jax").setLevel(logging.INFO if FLAGS.verbose else logging.WARNING)
