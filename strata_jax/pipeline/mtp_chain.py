"""The MTP chain: the model's multi-token-prediction draft layer on the last stage, run right after every window,
step and prefill chunk (`strata_jax.pipeline.stages.build_mtp_fn`; SERVING.md §3.3; llama.cpp ``draft-mtp``). It
catches up on the kept rows, then drafts the slot's next tokens, which wait on the device for `MtpChain.proposal`
(`strata_jax.proposers.MtpProposer` reads them).

Every engine has one (``engine.mtp``); it loads the layer on first `enable`, and runs nothing until then.
"""

from __future__ import annotations

import jax
import numpy as np

from strata_jax.errors import StrataError
from strata_jax.layers.linear import blocks_as_f32
from strata_jax.models.registry import mtp_head
from strata_jax.pipeline.stages import MAX_WINDOW, build_mtp_fn
from strata_jax.state import Rows

MAX_DRAFTS = MAX_WINDOW - 1  # a verify window holds the last accepted token + at most 7 proposals


class MtpChain:
    """An engine's MTP draft layer and its per-slot K/V and drafts.

    Args:
      engine: the `strata_jax.pipeline.engine.Engine` (its last stage's device holds the layer; its compile cache
        holds the chain's functions).

    Attributes:
      layer: the loaded MTP module (None until `enable`); it shares the trunk's head and embedding on that device.
      n_draft: drafts per chain (0: not running).
      state: the layer's per-slot K/V on the last stage's device (None until `enable`).
    """

    def __init__(self, engine):
        self.engine = engine
        self.layer = None
        self.n_draft = 0
        self.state = None
        self._graphdef = self._params = None
        self._last: dict[int, tuple] = {}

    @property
    def active(self) -> bool:
        """True while the chain runs after every window (`enable` / `set_chain`)."""
        return self.layer is not None and self.n_draft > 0

    def enable(self, n_draft: int) -> None:
        """Load the MTP layer on the last stage's device (first call) and, from now on, run the catch-up + draft
        chain after every window, step and prefill chunk: each slot's next ``n_draft`` proposals wait on the device
        for `proposal`. Idempotent; a larger ``n_draft`` lengthens the chain. Enable before the prompts are read
        (the MTP layer's K/V holds the prompt too).

        Raises:
          StrataError: the model has no MTP layer (``nextn_predict_layers`` = 0) or its tensors are missing;
            ``n_draft`` outside 1..7. UnsupportedError: a family without an MTP layer.
        """
        from flax import nnx

        eng = self.engine
        n_draft = int(n_draft)
        if not 1 <= n_draft <= MAX_DRAFTS:
            raise StrataError(f"MTP chain of {n_draft} drafts: must lie in 1..{MAX_DRAFTS}")
        if self.layer is None:
            if int(getattr(eng.cfg, "n_nextn", 0) or 0) <= 0:
                raise StrataError(f"{eng.gguf.path} ({eng.cfg.arch}) has no MTP layer (nextn_predict_layers = 0)")
            dev = eng.stages[-1].device
            with blocks_as_f32(eng.weights == "f32"):
                self.layer = mtp_head(eng.gguf, eng.cfg, dev, reuse=self._loaded_on(dev))
            self._graphdef, self._params = nnx.split(self.layer)
            self.state = self.layer.init_state(eng.n_slots, eng.max_context, eng.kv_dtype, dev)
        self.n_draft = max(self.n_draft, n_draft)

    def set_chain(self, n_draft: int) -> int:
        """Set the chain to exactly ``n_draft`` drafts (loading the layer on first use), or pause it with 0 (the
        layer stays loaded; `proposal` then returns what the last chain left). For benchmarks that compare chain
        lengths on one engine. Change it between sequences: windows run while the chain is paused are not read by the
        MTP layer, so its later drafts for that sequence are worse (never the output, which the verify window
        decides). Returns the chain length now running (0 for a model without an MTP layer).

        Raises:
          StrataError: ``n_draft`` outside 0..7.
        """
        n_draft = int(n_draft)
        if not 0 <= n_draft <= MAX_DRAFTS:
            raise StrataError(f"MTP chain of {n_draft} drafts: must lie in 0..{MAX_DRAFTS}")
        if n_draft == 0 or int(getattr(self.engine.cfg, "n_nextn", 0) or 0) <= 0:
            self.n_draft = 0
            return 0
        self.enable(n_draft)
        self.n_draft = n_draft
        return n_draft

    def resize(self, n_slots: int) -> None:
        """Fresh K/V for ``n_slots`` slots (after `Engine.set_slots`); drafts waiting are dropped."""
        if self.layer is not None:
            eng = self.engine
            self.state = self.layer.init_state(n_slots, eng.max_context, eng.kv_dtype, eng.stages[-1].device)
        self._last = {}

    def after(self, kind: str, out: dict, rows: Rows, next_tokens=None) -> None:
        """Launch the chain after the last stage's call (asynchronous; nothing is read back).

        Args:
          kind: the call's kind (``window``, ``step`` or ``prefill``).
          out: the last stage's outputs (``mtp_hidden``, ``picks``, ``n_keep``).
          rows: the call's layout (host numpy or on the last stage's device).
          next_tokens: int32 [B, T], prefill only: the token after each prompt row.
        """
        h = out["mtp_hidden"]
        B, T = h.shape[:2]
        if kind == "prefill":
            nxt, n_use = np.asarray(next_tokens, np.int32), rows.n_valid
        else:
            nxt = out["picks"]
            n_use = out["n_keep"] if kind == "window" else rows.n_valid
        mode = "prefill" if kind == "prefill" else "window"
        key = ("mtp", mode, B, T, self.n_draft, self.engine.n_slots)
        fn = self.engine.cache.get(key, lambda: build_mtp_fn(self._graphdef, mode, self.n_draft))
        drafts, probs, self.state = fn(self._params, self.state, h, nxt, rows, n_use)
        for b, s in enumerate(np.asarray(rows.slot).tolist()):
            self._last[int(s)] = (drafts, probs, rows.pos0, n_use, b)

    def proposal(self, slot: int) -> tuple[int, list[int], list[float]] | None:
        """The drafts waiting for ``slot``: (position of the token they follow, drafts, probabilities), or None
        before the slot's first prompt. Reads them from the device (waits for the chain)."""
        got = self._last.get(int(slot))
        if got is None:
            return None
        drafts, probs, pos0, n_use, b = jax.device_get(got[:4]) + (got[4],)
        pos = int(np.asarray(pos0)[b]) + int(np.asarray(n_use)[b])
        return pos, np.asarray(drafts)[b].tolist(), np.asarray(probs)[b].astype(float).tolist()

    def _loaded_on(self, device) -> dict:
        """The head and embedding modules the stages already hold on ``device`` (shared with the MTP layer)."""
        eng = self.engine
        got = {}
        for st in eng.stages:
            if st.device != device:
                continue
            m = st.module
            if getattr(m, "embed", None) is not None:
                got["token_embd.weight"] = m.embed
            if st.last and not eng.cfg.tied_head and getattr(m, "head", None) is not None:
                got["output.weight"] = m.head
        return got
