#!/bin/bash
# Written at the end of 2026-12-07 (fourth session) for the next session's second device call: the 48-layer
# Flash-Next file (written on the device) with this session's defaults (prefill f16 but GDN's q/k/v, the 2026-12-07
# GEMV table, the K split per call site): decode through strata-generate and prefill at 512 / 2048 / 8192 tokens
# (time to first token of an 8K prompt: issue 14's <= 3 s), llama-bench pp512 / tg128 on the same file.
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=570 bash experiments/results/s2026-12-07d/next2.sh
TOTAL=${TOTAL:-570}
source experiments/subruns.sh
run a 560 PARTS="env realfile_write realfile_generate realfile_prefill realfile_anchor" REAL_PROMPTS=512,2048,8192 REALFILE_S=170
echo "total $(( $(date +%s) - T0 )) s"
