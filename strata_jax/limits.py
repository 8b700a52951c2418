"""Limits and defaults shared by the engine and the command line, in a module without JAX, so that the CLI's flag
definitions (and ``--help``) load in a fraction of a second: the prefill chunk (rows per prefill program call), the
sampler's top-k cap and the seed range."""

PREFILL_CHUNK = 128  # the default of --prefill_chunk (rows per prefill chunk)
PREFILL_CHUNK_STEP = 16  # chunks are a multiple of this: the row tiles of the prefill kernels (GEMM, QSA) divide it
TOP_K_MAX = 1024
TOP_K_DEFAULT = 64  # what top_k 0 means (Strata's cap)
SEED_MAX = 2 ** 32 - 1  # seeds are 32-bit (the device key); the command line refuses others
