#!/bin/bash
# Written at the end of 2026-12-07 (fourth session) for the next session's first device call: (a) the compiled
# tests of that session's changes (the K split sized per call site, test_k_split_independent_of_rows; the GEMV config
# table; test_block_prefill_close with planar weights at f16; the grouped experts and the layers' kernel path); (b)
# the GEMV sweep now that routed experts are timed as the engine runs them (M rows read a union of M x 10 experts,
# the split sized for 10 slots): what the split fix costs the 2..8-row windows; (c) the steps program's cold compile
# with and without XLA's while-loop unrolling.
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=560 bash experiments/results/s2026-12-07d/next1.sh
TOTAL=${TOTAL:-560}
source experiments/subruns.sh
run a 200 PARTS="env pallas" PALLAS_S=190 PALLAS_FILES="tests/pallas/test_planar.py tests/pallas/test_gdn.py tests/pallas/test_grouped_experts.py tests/pallas/test_layers_kernel_path.py" \
  PALLAS_K="(k_split or config_tables or kblock_f16 or gemm_precisions or rows or segments or block_prefill or window or grouped) and not interpret"
run b 180 PARTS="env random_gguf sweep" SWEEP_ONLY=gemv SWEEP_ROWS=1,2,8 SWEEP_S=170
run c 170 PARTS="env compile_steps" COMPILE_S=160 COMPILE_XLA="base=|nounroll=--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_NO_UNROLL"
echo "total $(( $(date +%s) - T0 )) s"
