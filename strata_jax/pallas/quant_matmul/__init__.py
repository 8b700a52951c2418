"""Matmul by a GGUF block-quantized weight (``qmatmul``). See `api` for the contract."""

from strata_jax.pallas.quant_matmul.api import KERNEL_FORMATS, qmatmul
from strata_jax.pallas.quant_matmul.reference import dequantize_weight, matmul_rows

__all__ = ["KERNEL_FORMATS", "dequantize_weight", "matmul_rows", "qmatmul"]
