#!/bin/bash
# 2026-12-07 (fifth session), the last call: the compiled tests of the f16 prefill tiles (bits of SUB 2 / 3 stages
# against KBLOCK_PREFILL, MoE row sub-tiles), then the 1.5B file's prefill (512-token prompt, chunks of 512) with
# this tree (new tiles) and with the tree before them (.carry/old = a2456ff), alternating, in one process each.
#   BASE=a2456ff bash experiments/device_session.sh prepare   # here, first
#   device run (carry [".carry"]): bash experiments/results/s2026-12-07e/call6.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
python3 -c "import jax; print(jax.__version__, jax.devices()[0].device_kind)"
env PYTHONPATH=/tmp/site:$PWD python3 -m strata_jax.testing.random_gguf fill experiments/data/qwen2.5-coder-1.5b.header.xz /tmp/q15.gguf | tail -1
env PYTHONPATH=/tmp/site:$PWD STRATA_TEST_GPU=1 timeout 70 python3 -m pytest -q -p no:cacheprovider \
  tests/pallas/test_planar.py tests/pallas/test_grouped_experts.py -k "(f16_prefill_tiles or row_sub_tiles) and not interpret" 2>&1 | tail -3
# the script puts its repository first on sys.path: the old tree's copy of it imports the old package
mkdir -p .carry/old/experiments && cp experiments/bench_prefill.py .carry/old/experiments/
for tree in new old new old; do
  dir=.; [ $tree = old ] && dir=.carry/old
  echo "== $tree"
  env PYTHONPATH=/tmp/site timeout 60 python3 $dir/experiments/bench_prefill.py --model /tmp/q15.gguf --prompts 512 --chunks 512 \
    --repeats 3 --out "$OUT/prefill_$tree.json" 2>&1 | grep -E "^prompt|error|Error" | tail -2
done
