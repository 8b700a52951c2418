#!/bin/bash
# Written at the end of 2026-12-07 (seventh session): the 1.5B file's aggregate decode at 2 / 4 / 8 streams with the
# new defaults (this session: 1,769.1 tok/s at 4, one run of 0.28 s; 8 streams ran out of time compiling) beside
# llama-batched-bench, then one stream beside llama-bench tg128. The build waits before the timed parts.
#   device run (carry [".carry"]): TOTAL=590 bash experiments/results/s2026-12-07g/next3.sh
TOTAL=${TOTAL:-590}
source experiments/subruns.sh
run a 420 PARTS="env random_gguf anchor batch_gen anchor_batched" ANCHOR_S=120 BATCH_NS="2 4 8" BATCH_S=220
run b 160 PARTS="env random_gguf generate"
echo "total $(( $(date +%s) - T0 )) s"
