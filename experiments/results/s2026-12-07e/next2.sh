#!/bin/bash
# Written at the end of 2026-12-07 (fifth session): the 48-layer Flash-Next file with this session's prefill tiles:
# prefill 512 / 2,048 / 8,192 tokens in chunks of 512 and 2,048 (the MoE's 4 row sub-tiles make 2,048-row chunks'
# grouped GEMMs 0.60x the time they took: is 2,048 now the better chunk?), llama-bench in the same call.
#   device run (carry [".carry"]): TOTAL=570 bash experiments/results/s2026-12-07e/next2.sh
TOTAL=${TOTAL:-570}
source experiments/subruns.sh
run a 560 PARTS="env realfile_write realfile_prefill realfile_anchor" \
  REAL_PROMPTS=512,2048,8192 REAL_CHUNKS=512,2048 REALFILE_S=220
echo "total $(( $(date +%s) - T0 )) s"
