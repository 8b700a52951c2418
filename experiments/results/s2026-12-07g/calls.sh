#!/bin/bash
# The device calls of 2026-12-07 (seventh session), one H100 lease, in order; logs in
# experiments/results/h100_2026-12-07g/call<N>/. Here first: BASE=049af54 bash experiments/device_session.sh prepare
# device run (carry [".carry"]): bash experiments/results/s2026-12-07g/calls.sh N
XC=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT
case "$1" in
  1) TOTAL=570 bash experiments/results/s2026-12-07f/next1.sh ;;   # IQ2_S compiled x3; xla_ab 16 layers, 2 rounds
  2) TOTAL=240 bash -c "source experiments/subruns.sh; run a 235 PARTS='env exactness' EX_REQ=16 EX_NEW=256 XLA_FLAGS=$XC" ;;
  3) TOTAL=590 bash -c "source experiments/subruns.sh; run a 580 PARTS='env realfile_write realfile_generate realfile_anchor' REALFILE_S=200 XLA_FLAGS=$XC" ;;
  4) TOTAL=240 bash -c "source experiments/subruns.sh; run b 235 PARTS='env realfile_write realfile_generate' REALFILE_S=220" ;;
  5) TOTAL=280 bash -c "source experiments/subruns.sh; run a 150 PARTS='env random_gguf anchor' ANCHOR_S=120; run b 110 PARTS='env random_gguf prefill' PREFILL_S=95 PREFILL_PROMPTS=512,2048 PREFILL_CHUNKS=512" ;;
  6) TOTAL=230 bash -c "source experiments/subruns.sh; run a 110 PARTS='env random_gguf generate anchor' ANCHOR_S=40; run b 90 PARTS='env random_gguf generate' XLA_FLAGS=$XC" ;;
  7) TOTAL=195 bash -c "source experiments/subruns.sh; run a 110 PARTS='env random_gguf batch_gen' BATCH_NS='4 8' BATCH_S=100 XLA_FLAGS=$XC; run b 80 PARTS='env random_gguf anchor_batched'" ;;
  *) echo "usage: calls.sh 1..7"; exit 2 ;;
esac
