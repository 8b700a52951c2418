#!/bin/bash
# Prepared 2026-12-07 (second session); not run yet. Does the number of graph nodes set the Flash-Next decode step?
# The 16-layer decode steps (command buffers on) by default and with STRATA_ROW_MAP=xla (~48 fewer launches per
# token, exact on the GPU: pallas_rowmap_xla passed on 2026-12-07b), alternated three times in one call for the
# spread (one sample each on 2026-12-07b: 2.88 / 2.92 ms per token).
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (one nvidia-h100-x1 / nvidia-h200, carry [".carry"]): TOTAL=350 bash experiments/results/s2026-12-07b/call3.sh
TOTAL=${TOTAL:-350}
export FULL_LAYERS=16
source experiments/subruns.sh
for i in 1 2 3; do
  run k$i 57 PARTS="profile_full_steps" FULL_PROFILE_S=55
  run x$i 57 STRATA_ROW_MAP=xla PARTS="profile_full_steps" FULL_PROFILE_S=55
done
for d in k1 x1 k2 x2 k3 x3; do echo "$d $(grep -h "Flash-Next, steps, per token" $OUT0/$d/session.log 2>/dev/null | tail -1)"; done
echo "total $(( $(date +%s) - T0 )) s"
