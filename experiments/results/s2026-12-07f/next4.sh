#!/bin/bash
# Written at the end of 2026-12-07 (sixth session): the 1.5B file's prefill beside llama-bench pp512 in one call,
# the build waited for before anything is timed (this session's call 1 cut it: no llama.cpp figure), then our
# prefill with the f16 tiles (20,017 tok/s here, measured beside the unfinished build; 24,725 on 2026-12-07e).
#   device run (carry [".carry"]): TOTAL=580 bash experiments/results/s2026-12-07f/next4.sh
TOTAL=${TOTAL:-580}
source experiments/subruns.sh
run a 470 PARTS="env random_gguf anchor" ANCHOR_S=200
run b 100 PARTS="env random_gguf prefill" PREFILL_S=85 PREFILL_PROMPTS=512,2048 PREFILL_CHUNKS=512
echo "total $(( $(date +%s) - T0 )) s"
