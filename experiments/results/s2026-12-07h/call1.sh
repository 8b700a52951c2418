#!/bin/bash
# 2026-12-07, eighth session, call 1: the K-split partials of the attention output and the MLP's down projection
# added by the residual add + RMSNorm kernel behind them (STRATA_RESIDUAL_PARTIALS=1, new; 0 = the XLA sum fusion
# first) on the 1.5B file: the compiled kernel tests of it, decode steps A/B (profile_step --ab, 4 steps per program, command buffers on, 3 rounds
# alternating) while llama.cpp builds; then strata-generate (same 128 tokens expected) with each setting and
# llama-bench on the same file once the build is done.
#   here first: BASE=049af54 bash experiments/device_session.sh prepare
#   device run (carry [".carry"]): TOTAL=580 bash experiments/results/s2026-12-07h/call1.sh
TOTAL=${TOTAL:-580}
source experiments/subruns.sh
run a 300 PARTS="env random_gguf anchor pallas ab_steps" ANCHOR_WAIT_EARLY=0 AB_VARIANTS="off:STRATA_RESIDUAL_PARTIALS=0" \
  PALLAS_FILES="tests/pallas/test_planar.py tests/pallas/test_rows.py" PALLAS_K="(partials or add_rms_norm) and not interpret" PALLAS_S=60 \
  AB_ROUNDS=3 AB_S=250
run b 200 PARTS="env random_gguf generate anchor" GENERATE_S=60 ANCHOR_S=130
run c 75 PARTS="env random_gguf generate" GENERATE_S=60 STRATA_RESIDUAL_PARTIALS=0
for s in b c; do python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r.get('decode_tok_s') or r.get('tok_s'), r['tokens'][:8], len(r['tokens']))" $OUT0/$s/generate.json $s 2>/dev/null; done
echo "total $(( $(date +%s) - T0 )) s"
