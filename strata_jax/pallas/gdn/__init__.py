"""Gated delta rule (GDN mixer recurrence): verify window, commit, chunked prefill. See `api` for the contract."""

from strata_jax.pallas.gdn.api import T_MAX, gdn_chunked, gdn_commit, gdn_window
from strata_jax.pallas.gdn.reference import gdn_step

__all__ = ["T_MAX", "gdn_chunked", "gdn_commit", "gdn_step", "gdn_window"]
