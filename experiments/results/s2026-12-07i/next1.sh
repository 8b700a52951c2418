#!/bin/bash
# Written at the end of 2026-12-07 (ninth session) for the next one: the 48-layer Flash-Next file, a decoding slot
# beside an 8K-token read with --batch_read_share 0.5 (the default since b84ba2f) and then 1 (the old behaviour: a
# chunk before every window; this session's call 3 gave 5.5 of 136.5 tok/s). The first run compiles (~270 s cold
# for the 6 functions), the second reads the XLA cache.
#   here first: BASE=049af54 bash experiments/device_session.sh prepare
#   device run (carry [".carry"]): TOTAL=580 bash experiments/results/s2026-12-07i/next1.sh
TOTAL=${TOTAL:-580}
source experiments/subruns.sh
run a 575 PARTS="env realfile_write realfile_longread" REALFILE_S=400 LONGREAD_NEW=1500 LONGREAD_SHARES="1"
echo "total $(( $(date +%s) - T0 )) s"
