#!/bin/bash
# 2026-12-07, ninth session, call 1 (1.5B file): the one-step kernel-time profile (command buffers off: every kernel
# traced alone; kernel families per token) while llama.cpp builds, then STRATA_NORM_PLANES=1 against the defaults
# on the decode steps (3 rounds alternating), then strata-generate and llama-bench on the same file.
#   here first: BASE=049af54 bash experiments/device_session.sh prepare
#   device run (carry [".carry"]): TOTAL=580 bash experiments/results/s2026-12-07i/call1.sh
TOTAL=${TOTAL:-580}
source experiments/subruns.sh
run a 400 PARTS="env random_gguf anchor profile_new ab_steps" ANCHOR_WAIT_EARLY=0 \
  AB_VARIANTS="planes:STRATA_NORM_PLANES=1" AB_ROUNDS=3 AB_S=230
run b 170 PARTS="env random_gguf generate anchor" GENERATE_S=60 ANCHOR_S=100
echo "total $(( $(date +%s) - T0 )) s"
