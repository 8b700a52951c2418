"""Pallas kernels (and their plain-jnp references) for the hot ops of the hybrid MoE models.

One folder per op; each has ``reference.py`` (plain jnp: the numerical spec, and what the model runs off-GPU),
``kernel.py`` (Pallas, Triton lowering on GPU, interpret mode elsewhere), ``api.py`` (the public functions with
``impl="auto"|"reference"|"kernel"|"interpret"``, see `dispatch`) and ``__init__.py`` exporting the API.

* `strata_jax.pallas.gdn`: the gated delta rule: ``gdn_window`` (verify window, T <= 8, reads the state),
  ``gdn_commit`` (advance the state by the accepted rows), ``gdn_chunked`` (prefill).

Exactness contract shared by all ops: for T <= 8 rows, row t of a T-row call is bit-identical to the same row
computed alone (T = 1) and does not depend on the other rows' contents (for each impl separately).
"""
