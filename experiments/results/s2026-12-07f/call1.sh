#!/bin/bash
# 2026-12-07 (sixth session), issue 13's decode: do XLA's graph scheduling flags overlap the step's small kernels?
# The Flash-Next 16-layer decode steps (4 per program, command buffers on) in one process per XLA flag variant
# (`device_session.sh` part xla_ab), rounds alternating: the engine's flags (base); the command buffers' DAG from
# buffer uses instead of the latency-hiding scheduler's order (CONCURRENT: independent kernels -- the shared expert
# beside the router, the inject beside the down projection -- may run at once); the same with programmatic
# dependent launch (a kernel's launch overlaps its predecessor's tail where XLA emits it).
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=480 bash experiments/results/s2026-12-07f/call1.sh
TOTAL=${TOTAL:-480}
source experiments/subruns.sh
run a 470 PARTS="env xla_ab" XLA_AB_ROUNDS=2 XLA_AB_S=110 \
  XLA_AB="conc:--xla_gpu_command_buffer_scheduling_mode=CONCURRENT;pdl:--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_enable_pdl=true"
echo "total $(( $(date +%s) - T0 )) s"
