"""What a model family is to the engine: `Family`, one per GGUF ``general.architecture`` (`strata_jax.models.registry`).

A family file (``strata_jax/models/<arch>.py``) defines ``FAMILY = Family(...)``: the function that reads its GGUF
keys into a config (one function, the one place its metadata is read and its files' unstated facts are written down),
the stage module that runs a range of its layers, and its MTP draft layer if it has one. Shared pieces stay shared:
the attention-only families use `strata_jax.models.dense.DenseStage`, the hybrids
`strata_jax.models.hybrid.HybridStage`, and all of them the layers of `strata_jax.layers`.

Stage protocol (`strata_jax.models.dense.DenseStage` documents it): ``stage(g, cfg, start, stop, device)`` builds the
module for layers ``[start, stop)`` (embedding on the first stage, final norm + head on the last), with
``init_state(n_slots, max_context, kv_dtype, device)``, ``__call__(state, x, rows, mode, max_context, logits=...)``
and ``commit(state, pending, rows, keep)``. MTP protocol (`strata_jax.layers.mtp`): ``mtp(g, cfg, device, reuse)``
builds a module with ``init_state`` and ``draft``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from strata_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture's entry in the registry.

    Attributes:
      arch: the GGUF ``general.architecture`` it reads (e.g. ``"qwen35"``).
      read_config: ``(g) -> ModelConfig`` (or a subclass): the family's GGUF key reading, every key through the
        typed getters of `strata_jax.gguf.metadata` (type and range checked). Raises `StrataError` on a missing
        required key or a value of the wrong type or range, `UnsupportedError` on a variant the engine cannot run.
      stage: ``(g, cfg, start, stop, device=None) -> stage module`` (module docstring).
      mtp: ``(g, cfg, device=None, reuse=None) -> MTP draft layer``, or None for a family without one.
      recurrent: True when the family keeps recurrent state per slot (GDN state, conv history, PLE history) that a
        verify window leaves untouched until ``commit``; False when every cell it keeps is a K/V cell.
      description: one line for ``--help`` texts and error messages (the models it covers).
    """

    arch: str
    read_config: Callable[[Any], ModelConfig]
    stage: Callable[..., Any]
    mtp: Callable[..., Any] | None = None
    recurrent: bool = False
    description: str = ""
