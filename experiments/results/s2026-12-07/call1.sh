#!/bin/bash
# The device call prepared on 2026-12-06 (third session; never run: no machine came) plus compiled test_planar kblock
# cases and bench_kernels' dense prefill GEMMs (not run on 2026-12-07 either: its one call measured call2.sh). Sub-runs a (compiled
# tests, kernel benches), b / c (Flash-Next 16-layer prefill chunk, STRATA_GDN_PREFILL rows / blocked), e (blocked,
# 2048-row chunk), d (decode steps without command buffers), f (the old package .carry/old = 049af54). Here first:
#   BASE=049af54 bash experiments/device_session.sh prepare
# device run (one nvidia-h100-x1 / nvidia-h200, carry [".carry"]):
#   TOTAL=560 bash experiments/results/s2026-12-07/call1.sh
TOTAL=${TOTAL:-570}
export FULL_LAYERS=16
source experiments/subruns.sh
run a 260 PARTS="env pallas kernels" PALLAS_FILES="tests/pallas/test_gdn.py tests/pallas/test_grouped_experts.py tests/pallas/test_planar.py" \
  PALLAS_K="(chunked or sub_tiles or kblock) and not interpret" PALLAS_S=85 \
  KERNELS_ONLY=gdn_prefill,moe_prefill,prefill KERNELS_S=165
run b 90 PARTS="profile_full_prefill_new" FULL_PROFILE_S=85
run c 90 STRATA_GDN_PREFILL=blocked PARTS="profile_full_prefill_new" FULL_PROFILE_S=85
# a 2048-row chunk (MoE: ~40 rows per expert instead of ~10): ms per row against the 512-row chunk of b
run e 100 STRATA_GDN_PREFILL=blocked PARTS="profile_full_prefill_new" FULL_PROFILE_S=95 FULL_PREFILL_ARGS="--prefill_chunk 2048 --max_context 4096"
run d 110 FULL_STEPS_CB=0 PARTS="profile_full_steps" FULL_PROFILE_S=105
run f 90 PARTS="profile_full_prefill_old" FULL_PROFILE_S=85
echo "total $(( $(date +%s) - T0 )) s"
