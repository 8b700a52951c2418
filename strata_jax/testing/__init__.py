"""Helpers for tests and experiments (the engine never imports them).

* `strata_jax.testing.random_weights`: full-size geometries with random weights made on the device (`VirtualGGUF`).
* `strata_jax.testing.random_gguf`: same-shape random-weight GGUF files from a copied header (``python -m``).
* `strata_jax.testing.mtp_block`: a random MTP block appended to a tiny hybrid GGUF (``python -m``).
* `strata_jax.testing.exactness`: the batch-slot exactness harness (a staggered workload, its solo references,
  the comparison).
* `strata_jax.testing.batching`: the pure parts of the batching benchmark (``experiments/bench_batching.py``):
  workloads and arms, replayed acceptance, the report.
"""
