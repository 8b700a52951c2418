#!/bin/bash
# Prepared 2026-12-07 (third session), to run right after call 1 on the same warm machine (/tmp/flash.gguf, the
# 48-layer Flash-Next file, and the llama.cpp build are reused; on a fresh machine run a writes the file first).
# The K-block GEMM's f16 precision (STRATA_QMATMUL_PRECISION=f16) against the default bf16x2, each beside llama.cpp
# on the same file: a (the 48-layer file's prefill at f16; call 1 measured the default), b (the random 1.5B file:
# llama-bench pp512 / tg128, then our 512-token prefill in one chunk at bf16x2), c (the same at f16).
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=560 bash experiments/results/s2026-12-07c/call2.sh
TOTAL=${TOTAL:-560}
source experiments/subruns.sh
run a 200 STRATA_QMATMUL_PRECISION=f16 PARTS="env realfile_write realfile_prefill" REAL_PROMPTS=512,2048 REALFILE_S=180
run b 250 PARTS="env random_gguf prefill anchor" PREFILL_PROMPTS=512 PREFILL_CHUNKS=512 PREFILL_S=80
run c 80 STRATA_QMATMUL_PRECISION=f16 PARTS="prefill" PREFILL_PROMPTS=512 PREFILL_CHUNKS=512 PREFILL_S=75
echo "total $(( $(date +%s) - T0 )) s"
