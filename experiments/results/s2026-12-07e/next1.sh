#!/bin/bash
# Written at the end of 2026-12-07 (fifth session) for the next session's first device call: (a) the compiled tests of
# this session's prefill tiles (f16: dense SUB 2 / third stage, `gemm.kblock_config`; MoE KB = 128 and SUB per chunk,
# `gemm.moe_prefill_config`), row sub-tiles' bits and the hybrid parity compiled; (b) the 1.5B file's prefill with
# them beside llama-bench pp512 in the same call (0.83x on 2026-12-07d; the kernels' sweep predicts ~0.98x).
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=560 bash experiments/results/s2026-12-07e/next1.sh
TOTAL=${TOTAL:-560}
source experiments/subruns.sh
# a: the llama.cpp build starts first and runs beside the compiled tests (ANCHOR_WAIT_EARLY=0; 4-6 min on 16 cores),
# then llama-bench tg128 / pp512 on the 1.5B file; b: our prefill on the same file
run a 400 PARTS="env random_gguf pallas anchor" ANCHOR_WAIT_EARLY=0 ANCHOR_S=190 PALLAS_S=190 \
  PALLAS_FILES="tests/pallas/test_planar.py tests/pallas/test_grouped_experts.py tests/test_hybrid.py" \
  PALLAS_K="(f16_prefill_tiles or moe_prefill_config or row_sub_tiles or kblock or planar_prefill or matches or precise) and not interpret"
run b 150 PARTS="env random_gguf prefill" PREFILL_S=130 PREFILL_PROMPTS=512,2048 PREFILL_CHUNKS=512
echo "total $(( $(date +%s) - T0 )) s"
