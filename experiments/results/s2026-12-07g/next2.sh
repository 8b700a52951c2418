#!/bin/bash
# Written at the end of 2026-12-07 (seventh session): the 48-layer file's prefill at 512 / 2,048 / 8,192 tokens in
# chunks of 512 and 2,048 (is 2,048 the better chunk since the MoE's row sub-tiles?), llama-bench in the same call
# (the file is reused when the machine is still the one of next1.sh; the llama.cpp build runs beside the prefill
# compiles: the timed prefill runs are warm repeats).
#   device run (carry [".carry"]): TOTAL=570 bash experiments/results/s2026-12-07g/next2.sh
TOTAL=${TOTAL:-570}
source experiments/subruns.sh
run a 560 PARTS="env realfile_write realfile_prefill realfile_anchor" \
  REAL_PROMPTS=512,2048,8192 REAL_CHUNKS=512,2048 REALFILE_S=220
echo "total $(( $(date +%s) - T0 )) s"
