#!/bin/bash
# 2026-12-07 (third session), call 1: the 48-layer Flash-Next file (written on the device) read by our prefill with
# the defaults of 2026-12-07b (row-solve GDN prefill + split carry, one-stage MoE K-block GEMM) at bf16x2 (a) and with
# STRATA_QMATMUL_PRECISION=f16 (b), llama-bench pp512 / tg128 on the same file in the same call (a).
# Ran at c417913, before MoE prefill's f16 default (8196e44): run a now sets STRATA_QMATMUL_PRECISION=bf16x2 so
# that it measures the same thing again.
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=470 bash experiments/results/s2026-12-07c/call1.sh
TOTAL=${TOTAL:-470}
source experiments/subruns.sh
run a 350 STRATA_QMATMUL_PRECISION=bf16x2 PARTS="env realfile_write realfile_prefill realfile_anchor" REAL_PROMPTS=512,2048 REALFILE_S=200
run b 115 STRATA_QMATMUL_PRECISION=f16 PARTS="env realfile_prefill" REAL_PROMPTS=512,2048 REALFILE_S=110
echo "total $(( $(date +%s) - T0 )) s"
