"""MTP proposals: the model's own multi-token-prediction draft layer (llama.cpp ``draft-mtp``).

The drafting itself runs on the device, on the last stage, right after every window (`strata_jax.pipeline.mtp_chain`,
`strata_jax.pipeline.stages.build_mtp_fn`): the MTP layer catches up on the window's kept rows (each row's trunk
hidden with the token that followed it), then chains up to ``n_draft`` greedy drafts. `MtpProposer` only hands the
waiting drafts of its slot to the host loop that builds the next window, so proposing costs one small read and no
extra device call; ``last_probs`` (the MTP head's probability of each draft) lets ``--spec_min_p`` cut the chain.
"""

from __future__ import annotations

from strata_jax.proposers.base import Proposer


class MtpProposer(Proposer):
    """Drafts from the target's MTP layer for one slot.

    Args:
      engine: the target `strata_jax.pipeline.engine.Engine` (its MTP chain, ``engine.mtp``, is enabled here with ``n_draft``).
      n_draft: longest chain (the window cap minus one).
      slot: the slot whose drafts are read (`bind` changes it; the batch scheduler binds each request's slot).

    Raises:
      StrataError: the model has no MTP layer (from `MtpChain.enable`).
    """

    name = "mtp"

    def __init__(self, engine, n_draft: int = 3, slot: int = 0):
        super().__init__()
        engine.mtp.enable(n_draft)
        self.engine = engine
        self.slot = int(slot)

    def bind(self, slot: int) -> None:
        """Read the drafts of ``slot`` from now on."""
        self.slot = int(slot)

    def propose(self, history_ids, max_n, min_p=0.0):
        """The slot's waiting drafts (at most ``max_n``; cut at the first probability below ``min_p``). Empty when
        the drafts do not follow ``history_ids`` (e.g. the slot's last window was cut short)."""
        self.last_probs = None
        got = self.engine.mtp.proposal(self.slot)
        if got is None or max_n <= 0:
            return []
        pos, drafts, probs = got
        if pos != len(history_ids) - 1:
            return []
        n = min(int(max_n), len(drafts))
        if min_p > 0:
            k = 0
            while k < n and probs[k] >= min_p:
                k += 1
            n = k
        self.last_probs = probs[:n]
        return drafts[:n]
