#!/bin/bash
# Written at the end of 2026-12-07 (sixth session): the 48-layer Flash-Next file's decode through strata-generate
# with the engine's XLA flags and with CONCURRENT command-buffer scheduling (if next1.sh's A/B holds), llama-bench
# on the same file in the same call (the llama.cpp build runs beside the file's writing; the timed parts wait for it).
#   device run (carry [".carry"]): TOTAL=590 bash experiments/results/s2026-12-07f/next3.sh
TOTAL=${TOTAL:-590}
source experiments/subruns.sh
run a 330 PARTS="env realfile_write realfile_generate realfile_anchor" REALFILE_S=170
run b 250 PARTS="env realfile_write realfile_generate" REALFILE_S=230 \
  XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT
echo "total $(( $(date +%s) - T0 )) s"
