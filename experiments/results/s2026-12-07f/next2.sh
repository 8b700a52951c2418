#!/bin/bash
# Written at the end of 2026-12-07 (sixth session): batch exactness under the command buffers' CONCURRENT scheduling
# (independent kernels may run at once: a buffer reuse XLA got wrong would show as a token mismatch), the 8 runs of
# 2026-12-07e (serial, pipelined, batch_mtp, piped_mtp x greedy / seeded; 2 stages on one GPU, 4 slots, 32 x 512).
#   device run (carry [".carry"]): TOTAL=450 bash experiments/results/s2026-12-07f/next2.sh
TOTAL=${TOTAL:-450}
source experiments/subruns.sh
run a 440 PARTS="env exactness" EX_REQ=32 EX_NEW=512 \
  XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT
echo "total $(( $(date +%s) - T0 )) s"
