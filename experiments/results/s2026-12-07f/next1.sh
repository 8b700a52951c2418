#!/bin/bash
# Written at the end of 2026-12-07 (sixth session) for the next session's first device call (no llama.cpp build in
# it: this session's build ran on into the later sub-runs and slowed them): (a) the compiled test that failed here,
# test_kblock_accuracy[IQ2_S-kernel] (its traceback was cut by the part's timeout), three times with its seed
# printed; (b) the XLA scheduling A/B on the Flash-Next decode steps at 16 layers, two rounds alternating (base,
# CONCURRENT, CONCURRENT, base): this session's one sample each at 8 layers gave 1.538 vs 1.309 ms per token.
#   BASE=049af54 bash experiments/device_session.sh prepare      # here, first
#   device run (carry [".carry"]): TOTAL=570 bash experiments/results/s2026-12-07f/next1.sh
TOTAL=${TOTAL:-570}
source experiments/subruns.sh
mkdir -p $OUT0/t
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
for i in 1 2 3; do
  PYTHONPATH=/tmp/site:$PWD STRATA_TEST_GPU=1 timeout 60 python3 -m pytest -q -rf --tb=long -s -p no:cacheprovider \
    tests/pallas/test_planar.py -k "kblock_accuracy and IQ2_S and not interpret" > $OUT0/t/iq2s_$i.log 2>&1
  echo "IQ2_S run $i: rc=$?"; grep -E "seed=|Error|assert|passed|failed" $OUT0/t/iq2s_$i.log | head -6
done
run b 420 PARTS="env xla_ab" XLA_AB_ROUNDS=2 XLA_AB_S=100 FULL_LAYERS=16 \
  XLA_AB="conc:--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
echo "total $(( $(date +%s) - T0 )) s"
