#!/bin/bash
# Prepared 2026-12-07 (second session) for the next device time; not run yet. Sub-runs: a (the compiled MoE prefill
# precisions test at 1 and 2 pipelining stages: 2 failed once on an H100 with no traceback kept; its traceback now
# comes back), k (bench_kernels: the 2,048-row MoE prefill with row sub-tiles SUB 2 / 4, ~40 rows per expert, and
# the GDN prefill at T = 128 / 2048: the cases the budget cut twice).
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (one nvidia-h100-x1 / nvidia-h200, carry [".carry"]): TOTAL=250 bash experiments/results/s2026-12-07b/call2.sh
# The 48-layer real file with this session's prefill defaults, beside llama.cpp (a separate call, ~560 s):
#   PARTS="env realfile_write realfile_generate realfile_prefill realfile_anchor" REALFILE_S=210 BUDGET=560 bash experiments/device_session.sh run
TOTAL=${TOTAL:-250}
source experiments/subruns.sh
run a 80 PARTS="env pallas" PALLAS_FILES="tests/pallas/test_grouped_experts.py" \
  PALLAS_K="planar_prefill_precisions and not interpret" PALLAS_S=75
tar xzOf $OUT0/a/parts.tgz ./pallas.log 2>/dev/null | grep -E -A25 "^_{5,} |Error|^E " | head -60
run k 165 PARTS="kernels" KERNELS_ONLY=moe_prefill,gdn_prefill KERNELS_CASES="M=2048,T=2048,T=128" KERNELS_S=160
echo "total $(( $(date +%s) - T0 )) s"
