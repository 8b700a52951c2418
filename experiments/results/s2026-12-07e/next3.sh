#!/bin/bash
# Written at the end of 2026-12-07 (fifth session): issue 14's second goal on the 48-layer file: a slot's decode
# rate while an 8,192-token prompt is read beside it in --batch 2 (realfile_longread: >= 50% of the 1-stream rate,
# realfile_generate in the same call), and that prompt's time to first token.
#   device run (carry [".carry"]): TOTAL=570 bash experiments/results/s2026-12-07e/next3.sh
TOTAL=${TOTAL:-570}
source experiments/subruns.sh
run a 560 PARTS="env realfile_write realfile_generate realfile_longread" REALFILE_S=220
echo "total $(( $(date +%s) - T0 )) s"
