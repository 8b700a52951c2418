#!/bin/bash
# 2026-12-07 (third session), call 3: launches per Flash-Next decode token. (a) The 16-layer decode steps (command
# buffers on) on one engine, 4 variants recompiled in turn, 2 rounds (profile_step.py --ab): the default, the plane
# path's activations formed in the GEMV (STRATA_QMATMUL_XPLANES=kernel, ~1 launch fewer per plane-path GEMV),
# XLA's elementwise code for the narrow rows (STRATA_ROW_MAP=xla), both. (b) The compiled GEMV tests with the planes
# formed in the kernel (accuracy, row invariance) and the layers' kernel path with every plane format on it.
# (c) Cold compile of the 24-layer one-row step (abstract weights) without / with XLA's parallel LLVM compilation.
# Ran at c417913 (the tree with STRATA_QMATMUL_XPLANES and the compile_par part, both removed after this call).
#   device run (carry [".carry"]): TOTAL=470 bash experiments/results/s2026-12-07c/call3.sh
TOTAL=${TOTAL:-470}
export FULL_LAYERS=16
source experiments/subruns.sh
run a 230 PARTS="env ab_full_steps" AB_S=220 \
  AB_VARIANTS="k:STRATA_QMATMUL_XPLANES=kernel;x:STRATA_ROW_MAP=xla;kx:STRATA_QMATMUL_XPLANES=kernel,STRATA_ROW_MAP=xla"
run b 95 STRATA_QMATMUL_XPLANES=kernel STRATA_QMATMUL_PLANES=all PARTS="env pallas" PALLAS_S=85 \
  PALLAS_FILES="tests/pallas/test_planar.py tests/pallas/test_layers_kernel_path.py" \
  PALLAS_K="(gemv or block_window) and not interpret"
run c 140 PARTS="env compile_par" COMPILE_S=130 COMPILE_TIMEOUT=62 COMPILE_LAYERS=24
echo "total $(( $(date +%s) - T0 )) s"
