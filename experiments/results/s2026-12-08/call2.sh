#!/bin/bash
# 2026-12-08: issue 13, the plane path's activations read raw by the GEMV (STRATA_QMATMUL_PLANE_X=raw: no XLA
# concatenate launch before each plane-path GEMV; 2026-12-07i's 1.5B profile: 126 such launches, 0.263 ms of
# 1.82 ms of kernels per token). The compiled bits test (raw == prepared), then A/B on the 1.5B file's decode
# steps (raw; raw with Q6_K / Q8_0 on the plane path too) and on the Flash-Next shape at 16 layers.
#   device run (carry [".carry"]): TOTAL=590 bash experiments/results/s2026-12-08/call2.sh
TOTAL=${TOTAL:-590}
source experiments/subruns.sh
run a 300 PARTS="env random_gguf pallas ab_steps" PALLAS_FILES=tests/pallas/test_planar.py \
  PALLAS_K="raw_matches or rows_independent" PALLAS_S=100 AB_S=190 AB_ROUNDS=3 \
  AB_VARIANTS="raw:STRATA_QMATMUL_PLANE_X=raw;rawall:STRATA_QMATMUL_PLANE_X=raw,STRATA_QMATMUL_PLANES=all"
run b 280 PARTS="env ab_full_steps" FULL_LAYERS=16 AB_S=250 AB_VARIANTS="raw:STRATA_QMATMUL_PLANE_X=raw"
echo "total $(( $(date +%s) - T0 )) s"
