#!/bin/bash
# 2026-12-07, ninth session, call 3 (the 48-layer Flash-Next file, issue 14's ">= 50% of the solo rate while an
# 8K prompt is read" goal): the file written on the device, then --batch 2 with a decoding slot (64-token prompt,
# LONGREAD_NEW tokens) and an 8,192-token prompt arriving 5 s later (part realfile_longread); call 2's 200 s ran out
# while the 2-slot programs compiled (prefill 44.7 s, step 41.2 s, 1-of-2 step 39.7 s, then the 4-step program).
#   device run (carry [".carry"]): TOTAL=540 bash experiments/results/s2026-12-07i/call3.sh
TOTAL=${TOTAL:-540}
source experiments/subruns.sh
run a 535 PARTS="env realfile_write realfile_longread" REALFILE_S=410 LONGREAD_NEW=2000
echo "total $(( $(date +%s) - T0 )) s"
