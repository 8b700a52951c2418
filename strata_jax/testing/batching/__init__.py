"""The pure parts of the batching benchmark (``experiments/bench_batching.py``): `workload` (prompts, token counts,
arms), `replay` (acceptance draws, the replay proposer, acceptance recorded per output position), `report`
(summary, goals, markdown, plot)."""
