#!/bin/bash
# 2026-12-07 (fourth session), call 2: the prefill GEMM at f16 by default (gemm.DEFAULT_PRECISION; GDN's q/k/v
# projection keeps bf16x2, QLinear.precise): (a) the 48-layer Flash-Next file (written on the device) read in chunks
# of 512, llama-bench pp512 / tg128 on the same file; (c) the random 1.5B file's 512-token prefill (a dense model:
# every GEMM at f16) and llama-bench on it.
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=560 bash experiments/results/s2026-12-07d/call2.sh
TOTAL=${TOTAL:-560}
source experiments/subruns.sh
run a 330 PARTS="env realfile_write realfile_prefill realfile_anchor" REAL_PROMPTS=512,2048 REALFILE_S=190
run c 220 PARTS="env random_gguf prefill anchor" PREFILL_PROMPTS=512 PREFILL_CHUNKS=512 PREFILL_S=60
echo "total $(( $(date +%s) - T0 )) s"
