#!/bin/bash
# Written at the end of 2026-12-07 (eighth session) for the next one: on the 1.5B file, STRATA_NORM_PLANES=1 alone
# (the norm forms the plane-path GEMVs' inputs; its compiled test was cut by the part's time in call 1) against the
# defaults, and STRATA_RESIDUAL_PARTIALS=1 again (call 1's one round: 1.839 vs 1.575 ms per token), 3 rounds
# alternating, while llama.cpp builds; then strata-generate (defaults) and llama-bench on the same file.
#   here first: BASE=049af54 bash experiments/device_session.sh prepare
#   device run (carry [".carry"]): TOTAL=580 bash experiments/results/s2026-12-07h/next1.sh
TOTAL=${TOTAL:-580}
source experiments/subruns.sh
run a 400 PARTS="env random_gguf anchor pallas ab_steps" ANCHOR_WAIT_EARLY=0 \
  AB_VARIANTS="planes:STRATA_NORM_PLANES=1;partials:STRATA_RESIDUAL_PARTIALS=1" AB_ROUNDS=3 AB_S=240 \
  PALLAS_FILES="tests/pallas/test_planar.py" PALLAS_S=150 \
  PALLAS_K="(partials or norm_planes) and not interpret"
run b 170 PARTS="env random_gguf generate anchor" GENERATE_S=60 ANCHOR_S=100
echo "total $(( $(date +%s) - T0 )) s"
