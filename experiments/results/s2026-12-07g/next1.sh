#!/bin/bash
# Written at the end of 2026-12-07 (seventh session), for the next session's first call: the 48-layer Flash-Next file
# with this session's defaults (CONCURRENT command-buffer scheduling, compile ahead): issue 14's second goal -- a
# slot's decode rate while an 8,192-token prompt is read beside it in --batch 2 (realfile_longread: >= 50% of the
# 1-stream rate of realfile_generate, same call) and that prompt's time to first token.
#   here first: BASE=049af54 bash experiments/device_session.sh prepare
#   device run (carry [".carry"]): TOTAL=570 bash experiments/results/s2026-12-07g/next1.sh
TOTAL=${TOTAL:-570}
source experiments/subruns.sh
run a 560 PARTS="env realfile_write realfile_generate realfile_longread" REALFILE_S=200
echo "total $(( $(date +%s) - T0 )) s"
