"""The `impl=` rule shared by every op in `strata_jax.pallas`, and the helpers the kernels share.

`impl` values (each op's `api.py` takes them):

* ``"auto"`` (the default): the Pallas kernel when JAX's default backend is a GPU *and* the kernel can serve the
  call's shapes/dtypes; otherwise the plain-jnp reference. When a kernel cannot serve a call on a GPU, the reason is
  printed once per (op, reason) to stderr and the reference runs instead.
* ``"reference"``: the plain-jnp reference (what the model uses on CPU; also the numerical spec of the op).
* ``"kernel"``: the Pallas kernel compiled for the GPU (Triton lowering). Raises `UnsupportedError` when the
  kernel cannot serve the shapes, or when the default backend is not a GPU.
* ``"interpret"``: the same Pallas kernel run by Pallas' interpreter (any backend; slow; what CI uses on CPU).

The environment variable ``STRATA_PALLAS_IMPL`` (one of the four values) overrides ``"auto"`` (never an explicit
choice): e.g. ``STRATA_PALLAS_IMPL=interpret`` runs every op's kernel in interpret mode on CPU. Under the variable,
a call the kernel cannot serve (a prefill GEMM, a format without a kernel) falls back to the
reference with its reason printed once, as ``"auto"`` does on a GPU, so a whole model runs with the variable set;
an explicit per-call ``impl="kernel"`` / ``"interpret"`` still raises. The variable is read when a call is traced:
a function jitted before it changed keeps the path it was traced with.

``STRATA_PALLAS_OPS`` (comma-separated op-name prefixes, e.g. ``grouped_experts,gdn.gdn_window``), when set, limits
``"auto"`` calls to the kernels of those ops; every other op runs its reference (for bisecting a compile-time or
accuracy problem to one kernel: `experiments/compile_probe.py`).

Poisoning (for tests): inside ``with poison_outputs():`` every kernel call pre-fills its outputs with NaN (floats) /
the dtype's minimum (integers) through an aliased input buffer, so an element the kernel never writes shows up.
Pallas' interpreter already does this for freshly allocated outputs; the context also covers compiled GPU runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from strata_jax.errors import UnsupportedError

IMPLS = ("auto", "reference", "kernel", "interpret")

_printed: set[tuple[str, str]] = set()
_lock = threading.Lock()
_poison = threading.local()


def print_once(op: str, message: str) -> None:
    """Print ``strata_jax.pallas.<op>: <message>`` to stderr the first time this (op, message) pair is seen."""
    key = (op, message)
    with _lock:
        if key in _printed:
            return
        _printed.add(key)
    print(f"strata_jax.pallas.{op}: {message}", file=sys.stderr, flush=True)


def env_choice(name: str, default: str, allowed) -> str:
    """The value of environment variable ``name`` (``default`` when unset or empty), one of ``allowed``.

    Raises:
      UnsupportedError: another value, naming the variable and the choices.
    """
    v = os.environ.get(name, default) or default
    if v not in allowed:
        raise UnsupportedError(f"{name}={v!r} is not one of {tuple(allowed)}")
    return v


def on_gpu() -> bool:
    """True when JAX's default backend is a GPU (CUDA or ROCm)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def kernels_in_use() -> bool:
    """Whether ``impl="auto"`` calls may take a Pallas kernel now: ``STRATA_PALLAS_IMPL`` is ``kernel`` or
    ``interpret``, or it is ``auto`` (or unset) on a GPU backend. (What builds a program for the kernels, e.g. the
    per-layer weight buffers of `strata_jax.layers.stack`, asks this.)"""
    env = os.environ.get("STRATA_PALLAS_IMPL", "auto")
    if env == "reference":
        return False
    return on_gpu() if env == "auto" else True


def resolve(op: str, impl: str, why_not: Callable[[], str | None]) -> str:
    """Pick the path for one call: returns ``"reference"``, ``"kernel"`` or ``"interpret"``.

    Args:
      op: the op's name, for messages (e.g. ``"gdn.gdn_window"``).
      impl: the caller's choice, one of `IMPLS`.
      why_not: returns ``None`` when the kernel can serve this call, else a one-line reason (e.g. ``"Dk=96 is not a
        power of two"``). Only called when the kernel is a candidate.

    Raises:
      UnsupportedError: unknown ``impl``; ``"kernel"`` on a non-GPU backend; an explicit ``"kernel"`` /
        ``"interpret"`` for shapes the kernel cannot serve (``"auto"``, also when ``STRATA_PALLAS_IMPL`` names the
        kernel, falls back to the reference instead).
    """
    if impl not in IMPLS:
        raise UnsupportedError(f"{op}: impl={impl!r} is not one of {IMPLS}")
    fallback = False  # a kernel the caller did not name explicitly: fall back to the reference where it cannot serve
    if impl == "auto":
        env = os.environ.get("STRATA_PALLAS_IMPL", "auto")
        if env not in IMPLS:
            raise UnsupportedError(f"STRATA_PALLAS_IMPL={env!r} is not one of {IMPLS}")
        impl = env
        fallback = True
        only = os.environ.get("STRATA_PALLAS_OPS")
        if only is not None and not any(op.startswith(p.strip()) for p in only.split(",") if p.strip()):
            return "reference"
    if impl == "reference":
        return "reference"
    if impl == "auto" and not on_gpu():
        return "reference"
    reason = why_not()
    if reason is not None and fallback:
        print_once(op, f"the Pallas kernel cannot serve this call ({reason}); using the plain-jnp reference")
        return "reference"
    if impl == "auto":
        return "kernel"
    if reason is not None:
        raise UnsupportedError(f"{op}: the Pallas kernel cannot serve this call: {reason}")
    if impl == "kernel" and not on_gpu():
        raise UnsupportedError(
            f"{op}: impl='kernel' needs a GPU backend (default backend is {jax.default_backend()!r}); "
            "use impl='interpret' to run the kernel on this backend")
    return impl


@contextlib.contextmanager
def poison_outputs(enabled: bool = True):
    """Within this context, kernel outputs start as NaN / dtype-min, so unwritten elements are detectable."""
    old = getattr(_poison, "on", False)
    _poison.on = enabled
    try:
        yield
    finally:
        _poison.on = old


def poisoning() -> bool:
    return getattr(_poison, "on", False)


def poison_value(dtype) -> jax.Array:
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(jnp.nan, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.array(jnp.iinfo(dtype).min, dtype)
    return jnp.zeros((), dtype)


def triton_params(num_warps: int = 4, num_stages: int = 1):
    """Compiler parameters that select the Triton lowering of `pl.pallas_call` on GPU (jax 0.10 / 0.11)."""
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, *, out_shape: Sequence[jax.ShapeDtypeStruct], grid, in_specs, out_specs, interpret: bool,
                num_warps: int = 4, num_stages: int = 1, name: str | None = None,
                input_output_aliases: dict[int, int] | None = None):
    """`pl.pallas_call` with the Triton compiler params, and output poisoning when `poisoning()` is on.

    Returns a function of the inputs that returns a tuple of outputs (one per ``out_shape``). Poisoning adds one
    aliased input per output, filled with `poison_value`, with the output's BlockSpec; the kernel never sees it.
    ``input_output_aliases`` ({input index: output index}) updates inputs in place (an aliased output holds the
    input's values where the kernel does not write, and is never poisoned).
    """
    from jax.experimental import pallas as pl

    out_shape = tuple(out_shape)
    out_specs = tuple(out_specs)
    n_out = len(out_shape)
    aliases = dict(input_output_aliases or {})
    compiler_params = None if interpret else triton_params(num_warps, num_stages)
    if not poisoning():
        call = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=list(in_specs),
                              out_specs=out_specs, interpret=interpret, compiler_params=compiler_params, name=name,
                              input_output_aliases=aliases)
        return lambda *args: tuple(call(*args))
    n_in = len(in_specs)
    poisoned = [i for i in range(n_out) if i not in aliases.values()]

    def wrapped(*refs):
        ins = refs[:n_in]
        outs = refs[n_in + len(poisoned):]
        kernel(*ins, *outs)

    call = pl.pallas_call(wrapped, out_shape=out_shape, grid=grid,
                          in_specs=list(in_specs) + [out_specs[i] for i in poisoned], out_specs=out_specs,
                          interpret=interpret, compiler_params=compiler_params, name=name,
                          input_output_aliases={**aliases, **{n_in + j: i for j, i in enumerate(poisoned)}})

    def run(*args):
        poison = [jnp.full(out_shape[i].shape, poison_value(out_shape[i].dtype), out_shape[i].dtype)
                  for i in poisoned]
        return tuple(call(*args, *poison))

    return run


def f32_dot_precision(interpret: bool):
    """The ``precision`` of a float32 tile product (`lax.dot_general`) inside a kernel: TF32x3 on the tensor cores
    when compiled (three TF32 products, about float32 accuracy), plain float32 (HIGHEST) in interpret mode (XLA:CPU
    has no TF32)."""
    from jax import lax

    return (lax.Precision.HIGHEST, lax.Precision.HIGHEST) if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0
