#!/bin/bash
# Written at the end of 2026-12-07 (fifth session): what the routed experts' verify windows of 1 / 2 / 4 / 8 rows
# cost per token since the K split is sized for the experts per token (2026-12-07d's row-invariance fix), at the
# engine's configs (`gemv.choose_config`: Q2_K gate/up (16, 8, 4, 2112), Q4_0 down (16, 8, 2, 2112)) and two
# others; sweep_kernels times M rows over a union of M x 10 experts. Default plane path (STRATA_QMATMUL_PLANES=1).
#   device run (carry [".carry"]): TOTAL=300 bash experiments/results/s2026-12-07e/next4.sh
TOTAL=${TOTAL:-300}
source experiments/subruns.sh
run a 290 PARTS="env sweep_planes1" SWEEP_PLANES=1 SWEEP_SRC="--geometry qwen3.8-flash-next" \
  SWEEP_QTYPES=Q2_K,Q4_0 SWEEP_ROWS=1,2,4,8 SWEEP_TOP=4 SWEEP_S=270 \
  SWEEP_CONFIGS="16,8,4,2112,2;16,8,2,2112,2;32,4,4,1056,2;32,4,4,4224,2"
echo "total $(( $(date +%s) - T0 )) s"
