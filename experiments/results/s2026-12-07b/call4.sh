#!/bin/bash
# Prepared 2026-12-07 (second session); not run yet. The K-block GEMM's f16 precision (STRATA_QMATMUL_PRECISION=f16:
# one float16 product, rows scaled by powers of two; passes the dense parity tests in interpret mode where bf16 fails)
# against the default bf16x2, beside llama.cpp on the same file in the same call. Sub-runs: a (the random 1.5B file,
# llama.cpp built and run -- llama-bench pp512 / tg128 -- then our prefill of a 512-token prompt in one 512-row chunk,
# bf16x2), b (the same prefill at f16), c / d (the Flash-Next 16-layer prefill chunk at f16 / bf16x2).
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (one nvidia-h100-x1 / nvidia-h200, carry [".carry"]): TOTAL=560 bash experiments/results/s2026-12-07b/call4.sh
TOTAL=${TOTAL:-560}
export FULL_LAYERS=16
source experiments/subruns.sh
run a 330 PARTS="env random_gguf prefill anchor" PREFILL_PROMPTS=512 PREFILL_CHUNKS=512 PREFILL_S=80
run b 80 STRATA_QMATMUL_PRECISION=f16 PARTS="prefill" PREFILL_PROMPTS=512 PREFILL_CHUNKS=512 PREFILL_S=75
run c 75 STRATA_QMATMUL_PRECISION=f16 PARTS="profile_full_prefill_new" FULL_PROFILE_S=72
run d 75 PARTS="profile_full_prefill_new" FULL_PROFILE_S=72
echo "total $(( $(date +%s) - T0 )) s"
