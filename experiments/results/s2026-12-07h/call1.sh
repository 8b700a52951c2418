#!/bin/bash
# 2026-12-07, eighth session, call 1, on the 1.5B file (random Q4_K_M-like blocks):
#  - the compiled tests of this session's kernels (rows_add_partials_rms_norm, rows_norm_planes);
#  - decode steps A/B (profile_step --ab, 4 steps per program, command buffers on, 3 rounds alternating) while
#    llama.cpp builds: base = the defaults (both switches off), on = STRATA_RESIDUAL_PARTIALS=1 (the attention
#    output's and the MLP down's K-split partials added by the residual add + RMSNorm kernel behind them),
#    planes = that and STRATA_NORM_PLANES=1 (the norm's launch also forms the GEMVs' plane inputs);
#  - strata-generate with each setting (128 tokens) and llama-bench on the same file once the build is done.
#   here first: BASE=049af54 bash experiments/device_session.sh prepare
#   device run (carry [".carry"]): TOTAL=580 bash experiments/results/s2026-12-07h/call1.sh
TOTAL=${TOTAL:-580}
source experiments/subruns.sh
run a 280 PARTS="env random_gguf anchor pallas ab_steps" ANCHOR_WAIT_EARLY=0 \
  AB_VARIANTS="on:STRATA_RESIDUAL_PARTIALS=1;planes:STRATA_RESIDUAL_PARTIALS=1,STRATA_NORM_PLANES=1" \
  AB_ROUNDS=3 AB_S=200 \
  PALLAS_FILES="tests/pallas/test_planar.py tests/pallas/test_rows.py" PALLAS_S=60 \
  PALLAS_K="(partials or norm_planes or add_rms_norm) and not interpret"
run b 170 PARTS="env random_gguf generate anchor" GENERATE_S=60 ANCHOR_S=100
run c 60 PARTS="env random_gguf generate" GENERATE_S=55 STRATA_RESIDUAL_PARTIALS=1
run d 60 PARTS="env random_gguf generate" GENERATE_S=55 STRATA_RESIDUAL_PARTIALS=1 STRATA_NORM_PLANES=1
for s in b c d; do python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r.get('decode_tok_s'), r['tokens'][:8], len(r['tokens']))" $OUT0/$s/generate.json $s 2>/dev/null; done
echo "total $(( $(date +%s) - T0 )) s"
