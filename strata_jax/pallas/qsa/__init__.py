"""QSA sparse attention (indexer block selection + GQA softmax over the selected cells). See `api`."""

from strata_jax.pallas.qsa.api import (attend_cells, attend_cells_path, attend_range, attend_range_path, qsa_attention,
                                      qsa_prefill)
from strata_jax.pallas.qsa.reference import block_scores, select_blocks, selected_cells

__all__ = ["attend_cells", "attend_cells_path", "attend_range", "attend_range_path", "block_scores", "qsa_attention",
           "qsa_prefill", "select_blocks", "selected_cells"]
