#!/bin/bash
# The device call of 2026-12-07 (first session) for this session's two kernel changes, each against the code
# before it on the same card: the planar GEMV's prefetched loop (STRATA_QMATMUL_PREFETCH=2, the default, against 0)
# and the K-block prefill GEMM's offsets (this tree against .carry/old = 049af54). Here first:
#   BASE=049af54 bash experiments/device_session.sh prepare
# device run (one nvidia-h100-x1 / nvidia-h200, carry [".carry"]):
#   TOTAL=520 bash experiments/results/s2026-12-07/call2.sh
# Sub-runs (each $OUT/<letter>/: session.log, parts.tgz; the last ones are cut first when time runs out):
#   a  compiled test_planar (K-block, prefetch, GEMV accuracy / rows), the 1.5B file's prefill (512-token prompt,
#      chunk 512) and strata-generate (128 tokens) on this tree
#   b  strata-generate with STRATA_QMATMUL_PREFETCH=0 (the GEMV loop before)
#   c  the 1.5B prefill on the old package (the K-block kernel before)
#   d / e  Flash-Next 16 layers, bench_fullsize (4 steps per program): prefetch 2 / 0
TOTAL=${TOTAL:-520}
source experiments/subruns.sh
run a 230 PARTS="env random_gguf pallas prefill generate_1k" PALLAS_FILES="tests/pallas/test_planar.py" \
  PALLAS_K="(kblock or prefetch or gemv_accuracy or gemv_rows) and not interpret" PALLAS_S=75 \
  PREFILL_PROMPTS=512 PREFILL_CHUNKS=512 PREFILL_S=70 GENERATE_S=75
run b 70 STRATA_QMATMUL_PREFETCH=0 PARTS="generate_1k" GENERATE_S=65
l=$(left); if [ "$l" -gt 40 ]; then
  echo "##### c (old package prefill, up to 60 s)"; mkdir -p $OUT0/c
  timeout $(( l < 60 ? l : 60 )) env PYTHONPATH=/tmp/site:$PWD/.carry/old:$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 \
    JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache python3 experiments/bench_prefill.py --model /tmp/q15.gguf --prompts 512 \
    --chunks 512 --repeats 2 --out $OUT0/c/prefill_old.json > $OUT0/c/prefill_old.log 2>&1; echo "rc=$?"; tail -n 6 $OUT0/c/prefill_old.log
fi
export FULL_LAYERS=16 FULL_STEPS=4
run d 80 PARTS="fullsize" FULL_S=75
run e 80 PARTS="fullsize" FULL_S=75 FULL_ENV="STRATA_QMATMUL_PREFETCH=0"
echo "total $(( $(date +%s) - T0 )) s"
