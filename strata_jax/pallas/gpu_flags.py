"""XLA:GPU flags for the step program: command buffers (CUDA graphs) and pinned autotuning.

* Command buffers: XLA records the step's kernel launches (fusions, cuBLAS calls, custom calls -- the Pallas-Triton
  kernels are kernel launches -- and, with ``WHILE`` / ``CONDITIONAL``, loops and conditionals) into CUDA graphs and
  replays them with one launch per graph; ``xla_gpu_graph_min_graph_size=1`` makes every run of commands a graph.
  ``xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` builds each graph's edges from the buffers its commands
  read and write, so independent kernels (a layer's small GEMVs, norms and glue fusions) overlap; XLA's default
  (``LHS``) chains them in program order. Measured on an H100 (2026-12-07, experiments/RESULTS.md): the 48-layer
  Flash-Next file decodes at 164.9 against 136.7 tok/s, the 1.5B file at 601.9 against 558.1, the same tokens,
  and batch exactness holds under it. Same kernels, same arithmetic: only their order on the GPU changes.
  A profile of single kernels needs them off (``command_buffers=False``): a replayed graph is one trace event.
* Pinned autotuning: XLA times candidate GEMM / fusion configurations while compiling and keeps the fastest, so two
  processes (or two starts) may compile different programs. ``autotune="off"`` (``xla_gpu_autotune_level=0``)
  takes XLA's default configuration everywhere, ``autotune="cache:DIR"`` records each fusion's choice in DIR
  (``xla_gpu_per_fusion_autotune_cache_dir``) and reuses it, so a second process compiles the same program.

* Device memory: JAX's allocator takes 75% of a GPU's memory unless told otherwise, 59.4 of an H100's 79.2 GiB,
  where the Qwen3.8-Flash-Next shape (54 GB of weights) peaks at 61.9 GiB while it loads (H200, 2026-12-04): its
  build failed with RESOURCE_EXHAUSTED on an H100 (2026-12-05). `apply` sets ``XLA_PYTHON_CLIENT_MEM_FRACTION``
  to `MEMORY_FRACTION` when the environment does not set it.

XLA reads ``XLA_FLAGS`` once, when JAX starts its first backend: `apply` must run before any JAX computation.
Flags already in ``XLA_FLAGS`` win over these (a user's choice is kept), as does a memory fraction already set.
"""

from __future__ import annotations

import os

from strata_jax.errors import StrataError

MEMORY_FRACTION = "0.92"   # of the device's memory for JAX's allocator (the rest: CUDA context, cuBLAS, Triton)
COMMAND_BUFFER_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
COMMAND_BUFFER_SCHEDULING = "CONCURRENT"   # graph edges from buffer uses (XLA's default LHS: program order)


def xla_flags(command_buffers: bool = True, autotune: str = "off") -> list[str]:
    """The flags (``--name=value`` strings) for a GPU step.

    Args:
      command_buffers: record launches into CUDA graphs (True) or launch every kernel alone (False, for profiles).
      autotune: ``"off"``, ``"cache:DIR"`` or ``"default"`` (XLA's own autotuning, not pinned).

    Raises:
      StrataError: another ``autotune`` value.
    """
    flags = ([f"--xla_gpu_enable_command_buffer={COMMAND_BUFFER_TYPES}", "--xla_gpu_graph_min_graph_size=1",
              f"--xla_gpu_command_buffer_scheduling_mode={COMMAND_BUFFER_SCHEDULING}"]
             if command_buffers else ["--xla_gpu_enable_command_buffer="])
    if autotune == "off":
        flags.append("--xla_gpu_autotune_level=0")
    elif autotune.startswith("cache:") and len(autotune) > 6:
        flags.append(f"--xla_gpu_per_fusion_autotune_cache_dir={os.path.expanduser(autotune[6:])}")
    elif autotune != "default":
        raise StrataError(f"autotune={autotune!r}: expected off, cache:DIR or default")
    return flags


def merged(existing: str, flags: list[str]) -> str:
    """``existing`` (an ``XLA_FLAGS`` value) plus those of ``flags`` whose name it does not set already."""
    have = {f.split("=", 1)[0] for f in existing.split()}
    return " ".join(existing.split() + [f for f in flags if f.split("=", 1)[0] not in have])


def apply(flags: list[str]) -> str:
    """Add ``flags`` to ``os.environ["XLA_FLAGS"]`` (see `merged`) and set ``XLA_PYTHON_CLIENT_MEM_FRACTION`` to
    `MEMORY_FRACTION` where unset; returns the new ``XLA_FLAGS``.

    Raises:
      StrataError: a JAX backend is already initialised (XLA would ignore the change).
    """
    from jax._src import xla_bridge

    if getattr(xla_bridge, "_backends", None):
        raise StrataError("XLA flags must be set before JAX starts a backend (call gpu_flags.apply first)")
    value = merged(os.environ.get("XLA_FLAGS", ""), flags)
    os.environ["XLA_FLAGS"] = value
    if not os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"):
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = MEMORY_FRACTION
    return value
