#!/usr/bin/env bash
# One device call's worth of checks and timings (run through the device tool from the repository root; results go
# to $OUT). Parts: env, pallas (kernel tests on the GPU), kernels (bench_kernels), decode (bench_decode of the
# Qwen2.5-Coder-1.5B shape, reference vs kernels), full (full-size geometry split over the GPUs; FULL_ARGS adds
# flags), exact (batch exactness harness, EXACT_ARGS), exact_mtp (the anchor's 32 x 512 at 4 concurrent workload
# with MTP proposals on the tiny qwen4exp fixture + an MTP block, two stages; STAGE_ARGS="--same_device" on one GPU).
# Usage: bash experiments/device_run.sh PART [PART ...]
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ! python3 -c "import gguf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    env) nvidia-smi -L; python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" ;;
    pallas) STRATA_TEST_GPU=1 timeout 240 python3 -m pytest -q -x tests/pallas 2>&1 | tail -n 25 | tee "$OUT/pallas_tests.log" ;;
    kernels) timeout 300 python3 experiments/bench_kernels.py --out "$OUT/bench_kernels.json" 2>&1 | tail -n 40 | tee "$OUT/bench_kernels.txt" ;;
    decode)
      for impl in reference auto; do
        STRATA_PALLAS_IMPL=$impl timeout 240 python3 experiments/bench_decode.py --random_from experiments/data/qwen2.5-coder-1.5b.header.xz \
          --prompt_tokens 256 --decode_tokens 64 --out "$OUT/decode_1p5b_$impl.json" 2>&1 | tail -n 3
      done ;;
    full)
      timeout "${FULL_TIMEOUT:-420}" python3 experiments/bench_fullsize.py --geometry "${GEOMETRY:-qwen3.8-flash-next}" \
        ${SPLIT:+--layer_split $SPLIT} ${FULL_ARGS:-} --out "$OUT/full_${GEOMETRY:-qwen3.8-flash-next}.json" 2>&1 \
        | grep -v "^loading" | tail -n 12 ;;
    exact_mtp)
      python3 experiments/parity/add_mtp_block.py tests/fixtures/hybrid/qwen4exp_q8_0.gguf /tmp/qwen4exp_mtp.gguf >/dev/null
      timeout "${EXACT_TIMEOUT:-420}" python3 experiments/batch_exactness.py --model /tmp/qwen4exp_mtp.gguf --stages 2 \
        ${STAGE_ARGS:-} --slots 4 --requests 32 --new 512 --draft mtp --piped 3 --max_context 1024 \
        --sampled "${SAMPLED:-0,1}" --modes "${MODES:-piped_mtp,pipelined,batch_mtp,serial}" --out "$OUT/exactness_mtp.json" 2>&1 | tail -n 14 | tee "$OUT/exactness_mtp.txt" ;;
    exact) timeout 420 python3 experiments/batch_exactness.py ${EXACT_ARGS:-} 2>&1 | tail -n 30 | tee "$OUT/exactness.txt" ;;
    *) echo "unknown part $part" ;;
  esac
done
