#!/bin/bash
# 2026-12-07 (sixth session), after call2.sh on the same lease: (a) a cold start of strata-generate on the 1.5B file
# (empty XLA cache each run) with the decode program compiled beside the prefill (CompileCache.ahead) against one
# after the other (STRATA_COMPILE_AHEAD=0), two rounds; (b) the XLA scheduling A/B again (call2.sh b ran out of time).
#   device run (carry [".carry"]): TOTAL=380 bash experiments/results/s2026-12-07f/call3.sh
TOTAL=${TOTAL:-380}
source experiments/subruns.sh
run a 230 PARTS="env random_gguf cold_ab" COLD_S=50
run b 140 PARTS="env xla_ab" XLA_AB_ROUNDS=1 XLA_AB_S=65 FULL_LAYERS=8 \
  XLA_AB="conc:--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
echo "total $(( $(date +%s) - T0 )) s"
