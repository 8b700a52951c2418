"""Matmul by a GGUF block-quantized weight (``qmatmul``). See `api` for the contract."""

from strata_jax.pallas.quant_matmul.api import (KERNEL_FORMATS, PLANAR_FORMATS, prepare_weight, qmatmul,
                                               qmatmul_shared)
from strata_jax.pallas.quant_matmul.reference import dequantize_weight, matmul_rows

__all__ = ["KERNEL_FORMATS", "PLANAR_FORMATS", "dequantize_weight", "matmul_rows", "prepare_weight", "qmatmul",
           "qmatmul_shared"]
