#!/bin/bash
# 2026-12-07 (fourth session), call 3: the GEMV launch configs chosen from call 1's L2-cold sweep
# (STRATA_QMATMUL_GEMV_CONFIGS=2026-12-07, the new default) against the 2026-12-04 table, on the 16-layer Flash-Next
# decode steps (profile_step.py --ab: one engine, each variant recompiled, rounds alternating, command buffers on).
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=300 bash experiments/results/s2026-12-07d/call3.sh
TOTAL=${TOTAL:-300}
source experiments/subruns.sh
run a 290 PARTS="env ab_full_steps" FULL_LAYERS=16 AB_S=270 AB_VARIANTS="old:STRATA_QMATMUL_GEMV_CONFIGS=2026-12-04"
echo "total $(( $(date +%s) - T0 )) s"
