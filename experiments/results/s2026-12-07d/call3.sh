#!/bin/bash
# 2026-12-07 (fourth session), call 3: the GEMV launch configs chosen from call 1's L2-cold sweep
# (STRATA_QMATMUL_GEMV_CONFIGS=2026-12-07, the new default) against the 2026-12-04 table, on the 16-layer Flash-Next
# decode steps (profile_step.py --ab: one engine, each variant recompiled, rounds alternating, command buffers on)
# (a); the compiled GEMV tests under the new table (b).
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=200 bash experiments/results/s2026-12-07d/call3.sh
TOTAL=${TOTAL:-200}
source experiments/subruns.sh
run a 130 PARTS="env ab_full_steps" FULL_LAYERS=16 AB_S=120 AB_STEPS=24 AB_VARIANTS="old:STRATA_QMATMUL_GEMV_CONFIGS=2026-12-04"
run b 70 PARTS="env pallas" PALLAS_S=65 PALLAS_FILES="tests/pallas/test_planar.py" \
  PALLAS_K="(gemv or shared_launch or ragged) and not interpret"
echo "total $(( $(date +%s) - T0 )) s"
