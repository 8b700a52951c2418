#!/bin/bash
# 2026-12-07 (second session), after call1 of experiments/results/s2026-12-07 (H100): the GDN prefill reduced to the
# one-row solve + split carry and MoE prefill at one pipelining stage. Sub-runs a (the compiled tests: the MoE prefill
# precisions test that failed there, with its traceback; the GDN chunked kernel), b (the Flash-Next 16-layer prefill
# chunk with the new defaults, against b / c of that call), k (bench_kernels gdn_prefill / moe_prefill).
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (one nvidia-h100-x1 / nvidia-h200, carry [".carry"]): TOTAL=330 bash experiments/results/s2026-12-07b/call1.sh
T0=$(date +%s)
TOTAL=${TOTAL:-330}
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
OUT0=${OUT:-/tmp/out}
export FULL_LAYERS=16
run() { local sub=$1 b=$2; shift 2; local l; l=$(left); [ "$b" -gt "$l" ] && b=$l
  [ "$b" -lt 30 ] && { echo "=== $sub skipped ($l s left)"; return; }
  echo "##### $sub (budget $b s)"; env OUT=$OUT0/$sub BUDGET=$b "$@" bash experiments/device_session.sh run 2>&1 | grep -v "^\s*$" | grep -v "Target directory" | tail -n 40; }
run a 120 PARTS="env pallas" PALLAS_FILES="tests/pallas/test_grouped_experts.py tests/pallas/test_gdn.py" \
  PALLAS_K="(planar_prefill_precisions or sub_tiles or launch_settings or model_shapes) and not interpret" PALLAS_S=110
tar xzOf $OUT0/a/parts.tgz ./pallas.log 2>/dev/null | grep -E -A25 "^_{5,} |Error|^E " | head -70
run b 80 PARTS="profile_full_prefill_new" FULL_PROFILE_S=75
run k 120 PARTS="kernels" KERNELS_ONLY=gdn_prefill,moe_prefill KERNELS_S=115
echo "total $(( $(date +%s) - T0 )) s"
