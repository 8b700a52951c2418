#!/bin/bash
# 2026-12-08, the short form of call2.sh when little device time is left: the compiled raw == prepared bits test and
# the 1.5B file's decode-step A/B only.
#   device run (carry [".carry"]): TOTAL=400 bash experiments/results/s2026-12-08/call2b.sh
TOTAL=${TOTAL:-400}
source experiments/subruns.sh
run a $TOTAL PARTS="env random_gguf pallas ab_steps" PALLAS_FILES=tests/pallas/test_planar.py \
  PALLAS_K="raw_matches" PALLAS_S=60 AB_S=$(( TOTAL - 110 )) AB_ROUNDS=${AB_ROUNDS:-3} \
  AB_VARIANTS="${AB_VARIANTS:-raw:STRATA_QMATMUL_PLANE_X=raw;rawall:STRATA_QMATMUL_PLANE_X=raw,STRATA_QMATMUL_PLANES=all}"
echo "total $(( $(date +%s) - T0 )) s"
