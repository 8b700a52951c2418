"""The family registry: GGUF ``general.architecture`` -> the `strata_jax.models.family.Family` that runs it.

Each family lives in its own file, ``strata_jax/models/<module>.py``, which defines ``FAMILY``; `FAMILY_MODULES`
below has one line per family. Adding a family is that file plus that line (README, "Adding a model family").
Family modules are imported on first use, so asking which architectures exist imports nothing.
"""

from __future__ import annotations

import importlib

from strata_jax.errors import StrataError, UnsupportedError
from strata_jax.models.family import Family

# general.architecture -> module of strata_jax.models defining FAMILY (one line per family)
FAMILY_MODULES: dict[str, str] = {
    "llama": "llama",          # SmolLM2, Llama
    "qwen2": "qwen2",          # Qwen2 / Qwen2.5 (Coder)
    "gemma3": "gemma3",        # Gemma 3 text
    "qwen3": "qwen3",          # Qwen3 dense
    "qwen3moe": "qwen3moe",    # Qwen3 MoE
    "qwen35": "qwen35",        # Qwen3.5 dense hybrids
    "qwen35moe": "qwen35moe",  # Qwen3.5 / 3.6 MoE hybrids
    "qwen3next": "qwen3next",  # Qwen3-Next
    "qwen4exp": "qwen4exp",    # Qwen3.8-Flash-Next
}

_LOADED: dict[str, Family] = {}


def supported_archs() -> tuple[str, ...]:
    """The architectures the engine runs, in registry order."""
    return tuple(FAMILY_MODULES)


def get_family(arch: str, path=None) -> Family:
    """The `Family` of architecture ``arch`` (``path``: the file, for the error message).

    Raises:
      UnsupportedError: ``arch`` is not in the registry; the message names the supported ones.
      StrataError: the family module's ``FAMILY`` is missing or is for another architecture (a registry bug).
    """
    fam = _LOADED.get(arch)
    if fam is not None:
        return fam
    module = FAMILY_MODULES.get(arch)
    if module is None:
        where = f"{path}: " if path is not None else ""
        raise UnsupportedError(f"{where}unsupported architecture {arch!r} (supported: "
                               f"{', '.join(supported_archs())})")
    fam = getattr(importlib.import_module(f"strata_jax.models.{module}"), "FAMILY", None)
    if not isinstance(fam, Family) or fam.arch != arch:
        raise StrataError(f"strata_jax.models.{module} does not define FAMILY = Family({arch!r}, ...)")
    _LOADED[arch] = fam
    return fam


def family_of(g) -> Family:
    """The `Family` of an open GGUF (its ``general.architecture``); raises as `get_family`."""
    return get_family(g.architecture, g.path)


def config_from_gguf(g):
    """The config of an open GGUF, read by its family (`Family.read_config`).

    Raises:
      UnsupportedError: an architecture outside the registry, or a variant its family cannot run.
      StrataError: a required key is missing.
    """
    return family_of(g).read_config(g)


def check_stages(g, cfg, ranges) -> None:
    """Check every tensor the stages of ``ranges`` (``[(start, stop), ...]``) would load against the metadata, before
    any is read or placed: each stage is built abstractly (`strata_jax.layers.linear.dry_run` under
    `flax.nnx.eval_shape`), so its loaders run `strata_jax.layers.linear.check_tensor` and return shapes only. What a
    loader engine calls before the real build, so that a bad file is refused with nothing half-loaded.

    Raises:
      StrataError: the first tensor that is missing or disagrees with the metadata (shape or block format), one
        line naming the file, the tensor and the keys; UnsupportedError: a block format the engine cannot read.
    """
    from flax import nnx

    from strata_jax.layers.linear import dry_run

    stage = get_family(cfg.arch).stage
    with dry_run():
        for start, stop in ranges:
            nnx.eval_shape(lambda a=start, b=stop: stage(g, cfg, a, b, None))


def build_stage(g, cfg, start: int, stop: int, device=None):
    """The stage module for layers ``[start, stop)`` of ``cfg``'s family, weights placed on ``device``."""
    return get_family(cfg.arch).stage(g, cfg, start, stop, device)


def mtp_head(g, cfg, device=None, reuse: dict | None = None):
    """The MTP draft layer of ``cfg``'s family, loaded from ``g`` on ``device``.

    ``reuse``: modules already loaded on ``device`` that the MTP layer shares instead of loading a second copy
    (``"output.weight"``: the trunk's `QLinear` head; ``"token_embd.weight"``: its `Embedding`): the same device
    buffers, e.g. ~0.5 GB of Q6_K head at the Qwen3.8-Flash-Next vocabulary.

    Raises:
      UnsupportedError: a family without an MTP layer; StrataError: the file has no MTP tensors.
    """
    fam = get_family(cfg.arch)
    if fam.mtp is None:
        raise UnsupportedError(f"no MTP draft layer for architecture {cfg.arch!r}")
    return fam.mtp(g, cfg, device, reuse)


def recurrent_archs() -> tuple[str, ...]:
    """The architectures whose families keep recurrent state (`Family.recurrent`)."""
    return tuple(a for a in FAMILY_MODULES if get_family(a).recurrent)
