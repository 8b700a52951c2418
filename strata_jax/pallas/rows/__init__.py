"""Per-row ops of the model's row path (RMSNorm, L2 norm, row sums, softmax, narrow elementwise maps), one Pallas
program per row on the kernel path. See `api` for the contract."""

from strata_jax.pallas.rows.api import (add_rms_norm, hc_write_norm, qk_l2_norm, qk_l2_norm_packed, rms_norm,
                                        row_map, row_map_multi, row_sum, softmax, softmax_top_k)

__all__ = ["add_rms_norm", "hc_write_norm", "qk_l2_norm", "qk_l2_norm_packed", "rms_norm", "row_map",
           "row_map_multi", "row_sum", "softmax", "softmax_top_k"]
