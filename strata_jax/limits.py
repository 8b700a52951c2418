"""Limits and defaults shared by the engine and the command line, in a module without JAX, so that the CLI's flag
definitions (and ``--help``) load in a fraction of a second: the prefill chunk (rows per prefill program call), the
sampler's top-k cap and the seed range."""

PREFILL_CHUNK = 128  # the default of --prefill_chunk on a CPU (rows per prefill chunk)
# ... and on a GPU, where the context holds it: on the H200 a 512-row chunk read the 1.5B shape 2.5x (512-token
# prompt) to 3x (8192) faster than 128 rows (experiments/RESULTS.md, 2026-12-02 fourth session)
PREFILL_CHUNK_GPU = 512
# chunks are a multiple of this: the row tiles of the prefill kernels (GEMM, QSA tiles) divide it
PREFILL_CHUNK_STEP = 16
TOP_K_MAX = 1024
TOP_K_DEFAULT = 64  # what top_k 0 means (Strata's cap)
SEED_MAX = 2 ** 32 - 1  # seeds are 32-bit (the device key); the command line refuses others
DECODE_STEPS_GPU = 4  # plain decode steps per device program on a GPU (`Engine.run_steps`; H200 measurement)
DECODE_STEPS_MAX = 64  # most steps per program (each count is its own compiled program)
