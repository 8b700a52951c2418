#!/bin/bash
# 2026-12-07 (sixth session): the fifth session's next1.sh (compiled tests of the f16 prefill tiles, the 1.5B file's
# pp512 beside llama-bench) and call1.sh's XLA scheduling A/B cut to one round at 8 layers, in one call, for a day
# when device starts are scarce.
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=590 bash experiments/results/s2026-12-07f/call2.sh
TOTAL=${TOTAL:-590}
source experiments/subruns.sh
# a: the llama.cpp build runs beside the compiled tests; then llama-bench tg128 / pp512 on the 1.5B file
run a 360 PARTS="env random_gguf pallas anchor" ANCHOR_WAIT_EARLY=0 ANCHOR_S=150 PALLAS_S=170 \
  PALLAS_FILES="tests/pallas/test_planar.py tests/pallas/test_grouped_experts.py tests/test_hybrid.py" \
  PALLAS_K="(f16_prefill_tiles or moe_prefill_config or row_sub_tiles or kblock or planar_prefill or matches or precise) and not interpret"
# b: the Flash-Next decode steps (8 layers; its 60 s per process ran out beside the llama.cpp build) under the engine's XLA flags and with the command buffers' DAG scheduling
run b 125 PARTS="env xla_ab" XLA_AB_ROUNDS=1 XLA_AB_S=60 FULL_LAYERS=8 \
  XLA_AB="conc:--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
# c: our prefill on the 1.5B file (after the build: quiet host cores)
run c 100 PARTS="env random_gguf prefill" PREFILL_S=85 PREFILL_PROMPTS=512,2048 PREFILL_CHUNKS=512
echo "total $(( $(date +%s) - T0 )) s"
