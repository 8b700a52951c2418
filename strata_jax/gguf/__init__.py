"""GGUF files: a streaming header parser with memory-mapped tensor data (`reader`) and the block formats that
weights keep on the device (`blocks`)."""

from strata_jax.gguf.reader import GGUFFile, TensorInfo, open_gguf

__all__ = ["GGUFFile", "TensorInfo", "open_gguf"]
