"""Draft sources for speculative decoding on one sequence.

`Proposer` is the interface; `LookupProposer` (prompt lookup / suffix match), `DraftModelProposer` (a smaller GGUF
with the same tokenizer), `MtpProposer` (the model's MTP layer) and `ScriptedProposer` (tests) implement it;
`SpecPolicy` decides online when a proposer steps aside. `make_proposer` builds one from the command-line choice.
"""

from __future__ import annotations

from strata_jax.errors import StrataError
from strata_jax.proposers.base import Proposer, ScriptedProposer
from strata_jax.proposers.draft_model import DraftModelProposer, check_same_tokenizer
from strata_jax.proposers.lookup import LookupProposer
from strata_jax.proposers.mtp import MtpProposer
from strata_jax.proposers.policy import SpecPolicy

DRAFT_KINDS = ("none", "lookup", "model", "mtp")


def make_proposer(kind: str, target, *, draft_model: str | None = None, spec: int = 4, cache_dir=None,
                  **engine_kwargs) -> Proposer | None:
    """The proposer for ``--draft kind`` on the target Engine.

    Args:
      kind: ``none`` (returns None), ``lookup``, ``model`` (needs ``draft_model``: a registry name or .gguf path) or
        ``mtp`` (needs a model with an MTP layer).
      target: the target Engine.
      spec: the window cap (the draft model's catch-up window size).

    Raises:
      StrataError: unknown kind, ``model`` without ``draft_model``, a draft with another tokenizer, or ``mtp`` on a
        model without an MTP layer.
    """
    if kind == "none":
        return None
    if kind == "lookup":
        return LookupProposer()
    if kind == "model":
        if not draft_model:
            raise StrataError("--draft model needs --draft_model NAME_OR_PATH (a smaller GGUF with the same tokenizer)")
        from strata_jax.models_registry import resolve_model

        path = resolve_model(draft_model, cache_dir)
        return DraftModelProposer.load(path, target, window=spec, **engine_kwargs)
    if kind == "mtp":
        from strata_jax.proposers.mtp import MtpProposer

        if int(getattr(target.cfg, "n_nextn", 0) or 0) <= 0:
            raise StrataError(f"--draft mtp: {target.gguf.path} ({target.cfg.arch}) has no MTP layer "
                              f"(nextn_predict_layers = 0); use --draft lookup or --draft model")
        return MtpProposer(target, n_draft=max(1, min(int(spec), 8) - 1))
    raise StrataError(f"--draft {kind!r}: expected one of {', '.join(DRAFT_KINDS)}")


__all__ = ["Proposer", "ScriptedProposer", "LookupProposer", "DraftModelProposer", "MtpProposer", "SpecPolicy",
           "check_same_tokenizer", "make_proposer", "DRAFT_KINDS"]
