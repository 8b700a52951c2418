#!/bin/bash
# 2026-12-07 (third session), call 4: the grouped-expert GEMM of MoE prefill at f16 by default (gemm.EXPERTS_PRECISION;
# every other GEMM bf16x2), on the 48-layer Flash-Next file: (a) the new default, then llama-bench pp512 / tg128 on
# the same file; (b) STRATA_QMATMUL_PRECISION=bf16x2 (the old default) in the same call; (c) the random 1.5B file's
# 512-token prefill (a dense model: no experts) at bf16x2 and at f16 (STRATA_QMATMUL_PRECISION=f16).
# Ran at 8196e44. Then, on the same machine (device tool commands, logs not kept: their summary is in
# experiments/results/h100_2026-12-07c/call4/output_tail.txt):
#   export PYTHONPATH=/tmp/site:$PWD; STRATA_TEST_GPU=1 python3 -m pytest -q -rf --tb=line tests/pallas/test_grouped_experts.py \
#     tests/pallas/test_planar.py tests/pallas/test_layers_kernel_path.py -k "(prefill or grouped_experts_planar or precision) and not interpret"
#   (the same, --tb=short, test_grouped_experts.py -k "test_planar_prefill_precisions and kernel-kblock")
#   (at c546c21's bounds) ... -k "(test_planar_prefill_precisions or grouped_experts_planar) and kernel"
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=560 bash experiments/results/s2026-12-07c/call4.sh
TOTAL=${TOTAL:-560}
source experiments/subruns.sh
run a 330 PARTS="env realfile_write realfile_prefill realfile_anchor" REAL_PROMPTS=512,2048 REALFILE_S=190
run b 85 STRATA_QMATMUL_PRECISION=bf16x2 PARTS="env realfile_prefill" REAL_PROMPTS=512,2048 REALFILE_S=80
run c 70 PARTS="env random_gguf prefill" PREFILL_PROMPTS=512 PREFILL_CHUNKS=512 PREFILL_S=50
run d 55 STRATA_QMATMUL_PRECISION=f16 PARTS="env prefill" PREFILL_PROMPTS=512 PREFILL_CHUNKS=512 PREFILL_S=50
echo "total $(( $(date +%s) - T0 )) s"
