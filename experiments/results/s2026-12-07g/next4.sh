#!/bin/bash
# Written at the end of 2026-12-07 (seventh session): where a decode token's kernel time goes now (command buffers
# off: every kernel traced alone) on the 1.5B file (issue 13's 1.2x goal: 602 -> 700 tok/s) and the Flash-Next
# shape at 16 layers (2x goal); then the routed experts' 1 / 2 / 4 / 8-row window GEMVs (2026-12-07e next4.sh).
#   device run (carry [".carry"]): TOTAL=580 bash experiments/results/s2026-12-07g/next4.sh
TOTAL=${TOTAL:-580}
source experiments/subruns.sh
run a 300 PARTS="env random_gguf profile_new profile_full_steps" FULL_LAYERS=16 FULL_STEPS_CB=0 FULL_PROFILE_S=200
run b 270 PARTS="env sweep_planes1" SWEEP_PLANES=1 SWEEP_SRC="--geometry qwen3.8-flash-next" \
  SWEEP_QTYPES=Q2_K,Q4_0 SWEEP_ROWS=1,2,4,8 SWEEP_TOP=4 SWEEP_S=250 \
  SWEEP_CONFIGS="16,8,4,2112,2;16,8,2,2112,2;32,4,4,1056,2;32,4,4,4224,2"
echo "total $(( $(date +%s) - T0 )) s"
