#!/bin/bash
# The device call prepared on 2026-12-06 (third session; never run: no machine could be started): the new GDN
# prefill kernels and MoE row sub-tiles compiled and timed, Flash-Next 16-layer prefill chunk profiles (the tree
# with STRATA_GDN_PREFILL rows / blocked, a 2048-row chunk, the old package .carry/old), and the Flash-Next decode
# steps without command buffers (every kernel traced on its own). Here first:
#   BASE=049af54 bash experiments/device_session.sh prepare
# device run (one nvidia-h100-x1 / nvidia-h200, carry [".carry"]):
#   TOTAL=560 bash experiments/results/s2026-12-06c/call2.sh
# Sub-runs (in this order: a b c e d f) each write $OUT/<letter>/ (session.log, parts.tgz), cut to the time left
# (their budgets add up to more than TOTAL: the last ones are cut first).
T0=$(date +%s)
TOTAL=${TOTAL:-570}
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
OUT0=${OUT:-/tmp/out}
export FULL_LAYERS=16
run() { local sub=$1 b=$2; shift 2; local l; l=$(left); [ "$b" -gt "$l" ] && b=$l
  [ "$b" -lt 30 ] && { echo "=== $sub skipped ($l s left)"; return; }
  echo "##### $sub (budget $b s)"; env OUT=$OUT0/$sub BUDGET=$b "$@" bash experiments/device_session.sh run 2>&1 | grep -v "^\s*$" | tail -n 40; }
run a 215 PARTS="env pallas kernels" PALLAS_FILES="tests/pallas/test_gdn.py tests/pallas/test_grouped_experts.py" \
  PALLAS_K="(chunked or sub_tiles) and not interpret" PALLAS_S=75 \
  KERNELS_ONLY=gdn_prefill,moe_prefill KERNELS_S=130
run b 90 PARTS="profile_full_prefill_new" FULL_PROFILE_S=85
run c 90 STRATA_GDN_PREFILL=blocked PARTS="profile_full_prefill_new" FULL_PROFILE_S=85
# a 2048-row chunk (MoE: ~40 rows per expert instead of ~10): ms per row against the 512-row chunk of b
run e 100 STRATA_GDN_PREFILL=blocked PARTS="profile_full_prefill_new" FULL_PROFILE_S=95 FULL_PREFILL_ARGS="--prefill_chunk 2048 --max_context 4096"
run d 110 FULL_STEPS_CB=0 PARTS="profile_full_steps" FULL_PROFILE_S=105
run f 90 PARTS="profile_full_prefill_old" FULL_PROFILE_S=85
echo "total $(( $(date +%s) - T0 )) s"
