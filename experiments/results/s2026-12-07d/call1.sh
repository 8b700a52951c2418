#!/bin/bash
# 2026-12-07 (fourth session), call 1: the GEMV launch-config sweep with each call's weights out of L2 (--cold_mb)
# at the 1.5B file's and the Flash-Next geometry's decode shapes, 1 and 8 rows (a); the compiled tests of the
# 2026-12-07c test changes (grouped experts' precisions, planar prefill) (b).
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=560 bash experiments/results/s2026-12-07d/call1.sh
TOTAL=${TOTAL:-560}
source experiments/subruns.sh
run a 360 PARTS="env random_gguf sweep" SWEEP_ONLY=gemv SWEEP_ROWS=1,8 SWEEP_S=300
run b 180 PARTS="env pallas" PALLAS_S=170 PALLAS_FILES="tests/pallas/test_grouped_experts.py tests/pallas/test_planar.py" \
  PALLAS_K="(prefill or grouped_experts or precision) and not interpret"
echo "total $(( $(date +%s) - T0 )) s"
