#!/bin/bash
# 2026-12-07 (fourth session), call 5 (on the same warm machine): the hybrid parity tests compiled on the GPU at the
# new prefill precision (f16, GDN's q/k/v at bf16x2), and test_precise_projections; test_dense_parity needs the real
# models, which the device cannot download (it failed with "download ... failed": not a result).
#   device run (carry [".carry"]): bash experiments/results/s2026-12-07d/call5.sh
export PYTHONPATH=/tmp/site:$PWD; mkdir -p $OUT
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf --tb=line tests/test_hybrid.py -k "matches or precise" 2>&1 | tail -8 | tee $OUT/hybrid_gpu.log
timeout 100 python3 -m pytest -q -p no:cacheprovider -rf --tb=line tests/test_dense_parity.py -k logits 2>&1 | tail -5 | tee $OUT/dense_gpu.log
