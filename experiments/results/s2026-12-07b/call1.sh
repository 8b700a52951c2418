#!/bin/bash
# 2026-12-07 (second session), after call1 of experiments/results/s2026-12-07 (H100): the GDN prefill reduced to the
# one-row solve + split carry, MoE prefill at one pipelining stage, and STRATA_ROW_MAP=xla (never run on a GPU).
# Sub-runs: a (compiled tests: the MoE prefill precisions test that failed there, now with its traceback; the GDN
# chunked kernel), s1 / s2 (the Flash-Next 16-layer decode steps, command buffers on, default / STRATA_ROW_MAP=xla:
# ms per token and launches), r (the layers' compiled exactness tests under STRATA_ROW_MAP=xla), b (the 16-layer
# prefill chunk with the new defaults, against b / c of that call).
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (one nvidia-h100-x1 / nvidia-h200, carry [".carry"]): TOTAL=320 bash experiments/results/s2026-12-07b/call1.sh
TOTAL=${TOTAL:-320}
export FULL_LAYERS=16
source experiments/subruns.sh
run a 95 PARTS="env pallas" PALLAS_FILES="tests/pallas/test_grouped_experts.py tests/pallas/test_gdn.py" \
  PALLAS_K="(planar_prefill_precisions or launch_settings) and not interpret" PALLAS_S=88
tar xzOf $OUT0/a/parts.tgz ./pallas.log 2>/dev/null | grep -E -A25 "^_{5,} |Error|^E " | head -60
run s1 60 PARTS="profile_full_steps" FULL_PROFILE_S=57
run s2 60 STRATA_ROW_MAP=xla PARTS="profile_full_steps" FULL_PROFILE_S=57
run r 60 PARTS="pallas_rowmap_xla" PALLAS_S=57
run b 75 PARTS="profile_full_prefill_new" FULL_PROFILE_S=72
echo "total $(( $(date +%s) - T0 )) s"
