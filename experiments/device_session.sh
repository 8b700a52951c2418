#!/usr/bin/env bash
# One device call (<= 10 minutes on an nvidia-h200) that measures issue 12's GPU step: the compiled Pallas kernel
# tests, the step profile of the Qwen2.5-Coder-1.5B shape (random blocks) on the old path (the package at BASE,
# default c6351ea, carried) and the new one, bench_decode, and llama.cpp on the same file; one short table at
# the end, full logs under $OUT.
#
#   bash experiments/device_session.sh prepare   # here, once before the call: fills the git-ignored .carry/
#                                                #   (.carry/whl: the gguf wheel; .carry/anchor: llama.cpp's
#                                                #   source and script; .carry/old: the old strata_jax package)
#   device run, carry [".carry"]:  bash experiments/device_session.sh run
#   bash experiments/device_session.sh dry       # here: every part that runs on a CPU, on the tiny fixture
#
# Parts of `run` in priority order (each under its own timeout, skipped when the call's time would run out): env
# (wheel, GPU, XLA flags accepted), llama.cpp build (background), random 1.5B GGUF, pallas (STRATA_TEST_GPU=1
# pytest tests/pallas: the compiled kernels and the references; interpret-mode cases are CI's), kernels
# (experiments/bench_kernels.py: every quantized-matmul variant of issues 13/14 -- GGUF-bytes kernel, planar GEMV,
# tensor-core GEMV, prefill GEMM precisions, grouped experts, launch configs -- in 210 s; KERNELS_ONLY: sections,
# KERNELS_CASES: substrings of the cases to run, e.g. "M=2048"), decode (experiments/bench_decode.py on the
# new path with the default kernels and with STRATA_QMATMUL=planar, command buffers on), profile_new
# (experiments/profile_step.py, command buffers off), profile_prefill (the same for one prefill chunk), profile_cb (the step with
# command buffers kept in the trace, host events, launches in and out of graphs), anchor (llama-bench tg128 / pp512), profile_old (the old
# path's step profile, c6351ea: last, as its figures are on record from 2026-12-01), table. Also: probe
# (compile_probe.py on the 1.5B file per op selection), shapes (each matrix of the file compiled alone),
# compile_repeat, sampler (compile_sampler.py: the sampler's pieces alone), decode_stacked (STRATA_STACK_LAYERS=1),
# prefill (experiments/bench_prefill.py: prompts 512 / 2048 / 8192 x --prefill_chunk 128 / 256 / 512, compile and
# peak memory per chunk size), generate (strata-generate, the user path), generate_1k (the same at --max_context 1024,
# bench_decode's), decode_unshared (STRATA_QMATMUL_SHARED=0: one launch per matrix), fullsize (bench_fullsize.py on
# the Qwen3.8-Flash-Next shape, one GPU; FULL_S, FULL_LAYERS; FULL_ENV, e.g. "STRATA_ROW_MAP=xla"), pallas_rowmap_xla
# (the layers' compiled exactness tests with STRATA_ROW_MAP=xla), sweep (experiments/sweep_kernels.py: GEMV and
# attention launch configs at the 1.5B file's and Flash-Next's shapes; SWEEP_S, SWEEP_ROWS, SWEEP_ONLY),
# profile_steps / profile_full_steps (profile_step.py --kind steps: 4 steps per program, per token, with the
# program's HLO; FULL_STEPS_CB=0: the Flash-Next steps without command buffers, every kernel traced on its own),
# profile_full_prefill_new / _old (one Flash-Next prefill chunk, the new tree and .carry/old; FULL_PREFILL_ARGS
# e.g. "--prefill_chunk 2048 --max_context 4096"),
# compile_steps (compile_probe.py --profile_top 30 on COMPILE_KINDS, default steps4x4, at COMPILE_LAYERS, default 48:
# where the cold compile of a full-size program goes; COMPILE_S; COMPILE_XLA: compile_probe's --xla_variants),
# ab_full_steps (profile_step.py --ab on the Flash-Next steps: AB_VARIANTS, e.g. "x:STRATA_ROW_MAP=xla", each
# variant recompiled on one engine, rounds alternating; AB_S, AB_STEPS, AB_ROUNDS), ab_steps (the same on the 1.5B
# file's decode steps, only when named in PARTS),
# cold_ab (only when named in PARTS: strata-generate on the 1.5B file from an empty XLA cache, the decode program
# compiled beside the prefill against after it, STRATA_COMPILE_AHEAD=1 / 0, two rounds; COLD_S per run),
# xla_ab (only when named in PARTS, with XLA_AB set: XLA flag variants of the same Flash-Next steps, one process each as XLA reads its flags once: XLA_AB
# "NAME:--flag=v --flag2=v;NAME2:..." against the engine's flags ("base": CONCURRENT command-buffer scheduling since
# 2026-12-07g; "lhs:--xla_gpu_command_buffer_scheduling_mode=LHS" is the old order), rounds alternating; XLA_AB_ROUNDS,
# XLA_AB_S per process; ms per token from each process's untraced timed programs, the traced run's kernel overlap),
# batch_gen (strata-generate --batch N, aggregate tok/s; BATCH_NS) and anchor_batched
# (llama-batched-bench on the same file). The real file path at full size (after fullsize; issue 12 item 8):
# realfile_write (../shared/tools/make_qwen4exp_gguf.py, carried in .carry/tools, writes /tmp/flash.gguf: the
# Flash-Next shape with random blocks, REAL_LAYERS layers (48: 53.6 GB, ~2 min); a file already there from an earlier
# call on a warm machine is reused unless REAL_REWRITE=1), realfile_generate (strata-generate --model on it, 64 tokens,
# --decode_steps as the GPU's default), realfile_batch (--batch 4 --max_context 8192: 4 requests of 64 tokens),
# realfile_longread (--batch 2: a decoding slot's rate while an 8,192-token prompt is read beside it; LONGREAD_SHARE,
# LONGREAD_SHARES: --batch_read_share for it and for runs after it),
# realfile_prefill (bench_prefill.py on it: REAL_PROMPTS in chunks of REAL_CHUNKS, default 512) and
# realfile_anchor (llama-bench on the same file, REPS=2; the llama.cpp build starts at the top of the call); each
# under REALFILE_S; only when named in PARTS. ANCHOR_WAIT_EARLY=0 lets the parts after pallas run beside the llama.cpp
# build (its 16 compile jobs made the first calls' compiles 2.6x slower on 2026-12-03: keep timed parts after it). Pick parts with PARTS="random_gguf probe
# ..." (time limits: DECODE_S, GENERATE_S, PREFILL_S, PROBE_S, REPEAT_S, SAMPLER_S, ANCHOR_S; BUDGET for the whole call). The device tool returns only a few files:
# the parts' logs and JSON come back in $OUT/parts.tgz beside $OUT/session.log.
set -uo pipefail
MODE=${1:-}
OUT=${OUT:-/tmp/out}
BASE=${BASE:-c6351ea}  # the commit the 2026-12-01 H200 figures were measured at (old path)
BUDGET=${BUDGET:-570}
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
PARTS=${PARTS:-all}  # e.g. PARTS="random_gguf decode_new generate": only those parts (default: all, in order)
want() { [ "$PARTS" = all ] || [[ " $PARTS " == *" $1 "* ]]; }
part() {  # part NAME SECONDS CMD...: run CMD with a timeout, logged to $OUT/NAME.log, if the budget allows
  local name=$1 secs=$2; shift 2
  want "$name" || return 0
  local l; l=$(left)
  if [ "$l" -lt 20 ]; then echo "=== $name skipped ($l s left)"; return; fi
  [ "$secs" -gt "$l" ] && secs=$l
  echo "=== $name ($(date +%T), up to $secs s)"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "    rc=$? ($(( $(date +%s) - T0 )) s elapsed)"; tail -n 4 "$OUT/$name.log" | sed 's/^/    /'
}

case "$MODE" in
  prepare)
    mkdir -p .carry/whl .carry/anchor .carry/old .carry/tools
    cp /opt/pypi/files/gguf-*.whl .carry/whl/ 2>/dev/null || python3 -m pip download -q --no-deps -d .carry/whl gguf
    cp ../shared/tools/llamacpp/* .carry/anchor/ 2>/dev/null || cp /work/shared/tools/llamacpp/* .carry/anchor/
    # the Flash-Next-shape GGUF writer of the realfile_* parts
    cp ../shared/tools/make_qwen4exp_gguf.py .carry/tools/ 2>/dev/null || cp /work/shared/tools/make_qwen4exp_gguf.py .carry/tools/
    rm -rf .carry/old/strata_jax .carry/old/configs && git archive "$BASE" strata_jax configs | tar -x -C .carry/old
    # the profiler's own modules (standalone), so that profile_step.py runs against the old package too
    cp strata_jax/pallas/trace.py strata_jax/pallas/gpu_flags.py .carry/old/strata_jax/pallas/
    du -sh .carry; git check-ignore -q .carry && echo ".carry is git-ignored (carry it by name)";;
  run|dry)
    mkdir -p "$OUT"
    exec > >(tee "$OUT/session.log") 2>&1  # the whole table comes back even when the reply's tail is cut
    export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache  # parts share compiled programs
    export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
    # JAX takes 75% of the GPU unless told: the 48-layer Flash-Next shape needs more on an H100 (gpu_flags.MEMORY_FRACTION)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
    if ! python3 -c "import gguf" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl || exit 1
    fi
    export PYTHONPATH=/tmp/site:$PWD
    NEW="env PYTHONPATH=/tmp/site:$PWD"
    OLD="env PYTHONPATH=/tmp/site:$PWD/.carry/old:$PWD"
    if [ "$MODE" = run ]; then
      MODEL=/tmp/q15.gguf; PROF="--steps 20 --warmup 3 --prompt_tokens 64"
      FLAGS=$(python3 -c "from strata_jax.pallas import gpu_flags as g; print(' '.join(g.xla_flags(True)))")
      part env 30 python3 -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices(), jax.devices()[0].device_kind)"
      part flags 30 env XLA_FLAGS="$FLAGS" python3 -c "import jax; print('XLA flags accepted:', jax.devices())"
      { want anchor || want realfile_anchor; } && bash .carry/anchor/anchor.sh build > "$OUT/anchor_build.log" 2>&1
      part random_gguf 60 python3 -m strata_jax.testing.random_gguf fill experiments/data/qwen2.5-coder-1.5b.header.xz $MODEL
      # issue 12 item 3: experiments/batch_exactness.py on the tiny qwen4exp fixture with a random MTP block, both
      # stages on this GPU (--same_device), the anchor's workload (EX_REQ x EX_NEW, 4 slots); one process per
      # (mode, greedy|seeded), all at once (each computes its own solo references); the pallas part runs beside it
      # when named after it in PARTS (the exactness processes start first, in the background)
      if want exactness; then
        python3 -m strata_jax.testing.mtp_block tests/fixtures/hybrid/qwen4exp_q8_0.gguf /tmp/qwen4exp_mtp.gguf \
          > "$OUT/exactness_fixture.log" 2>&1
        EX_PIDS=""
        for mode in ${EX_MODES:-serial pipelined batch_mtp piped_mtp}; do
          for s in 0 1; do
            timeout $(( $(left) - 15 )) env PYTHONPATH=/tmp/site:$PWD python3 experiments/batch_exactness.py \
              --model /tmp/qwen4exp_mtp.gguf --stages 2 --same_device --slots 4 --requests ${EX_REQ:-32} \
              --new ${EX_NEW:-512} --draft mtp --piped 3 --max_context 1024 --sampled $s --modes $mode \
              --out "$OUT/exact_${mode}_$s.json" > "$OUT/exact_${mode}_$s.log" 2>&1 &
            EX_PIDS="$EX_PIDS $!"
          done
        done
        echo "=== exactness: $(echo $EX_PIDS | wc -w) processes started ($(date +%T))"
      fi
      # -v: each test's name and result as it finishes, so a part cut by its timeout still says which failed
      part pallas ${PALLAS_S:-150} env STRATA_TEST_GPU=1 python3 -m pytest -v -rf --tb=short -p no:cacheprovider \
        ${PALLAS_FILES:-tests/pallas} -k "${PALLAS_K:-not hlo_loops and not interpret}"
      # are the layers row-exact on the GPU with XLA's own elementwise code for the narrow rows (no rows_map launches)?
      part pallas_rowmap_xla ${PALLAS_S:-150} env STRATA_ROW_MAP=xla STRATA_TEST_GPU=1 python3 -m pytest -v -rf --tb=short \
        -p no:cacheprovider tests/pallas/test_layers_kernel_path.py -k "not interpret"
      # the timings below need quiet host cores: wait here for the llama.cpp build (16 cores compiling slowed
      # bench_decode by ~25% on 2026-12-02); the compiled tests above run beside it
      [ "${ANCHOR_WAIT_EARLY:-1}" = 1 ] && want anchor && { bash .carry/anchor/anchor.sh wait > "$OUT/anchor_wait.log" 2>&1; echo "=== llama.cpp build done ($(( $(date +%s) - T0 )) s elapsed)"; }
      # launch configs of the GEMV and the attention kernel at the 1.5B file's and the Flash-Next shapes
      part sweep ${SWEEP_S:-300} python3 experiments/sweep_kernels.py --model $MODEL --geometry qwen3.8-flash-next \
        --rows ${SWEEP_ROWS:-1,8} --only ${SWEEP_ONLY:-gemv,attend} --budget_s $(( ${SWEEP_S:-300} - 60 )) \
        --out "$OUT/sweep.json"
      # the GEMV's plane path against its decoder path (STRATA_QMATMUL_PLANES=0), a few configs, GEMVs only
      for PL in ${SWEEP_PLANES:-0 1}; do
        part sweep_planes$PL ${SWEEP_S:-150} env STRATA_QMATMUL_PLANES=$PL python3 experiments/sweep_kernels.py \
          ${SWEEP_SRC:---model $MODEL --geometry qwen3.8-flash-next} ${SWEEP_QTYPES:+--qtypes $SWEEP_QTYPES} \
          --rows ${SWEEP_ROWS:-1,8} --rows_top ${SWEEP_TOP:-3} --only gemv \
          --gemv_configs "${SWEEP_CONFIGS:-32,4,4,1056,2;16,8,4,2112,2;64,4,4,1056,2;32,8,4,528,2}" \
          --budget_s $(( ${SWEEP_S:-150} - 50 )) --out "$OUT/sweep_planes$PL.json"
      done
      part kernels ${KERNELS_S:-230} python3 experiments/bench_kernels.py --only ${KERNELS_ONLY:-head,moe_variants,prefill,formats,sweep_planar} \
        --budget_s $(( ${KERNELS_S:-230} - 20 )) ${KERNELS_CASES:+--cases "$KERNELS_CASES"} --out "$OUT/kernels.json"
    else
      MODEL=tests/fixtures/hybrid/qwen4exp_q8_0.gguf; PROF="--steps 2 --warmup 1 --prompt_tokens 8 --max_context 64"
      part env 60 python3 -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())"
      bash .carry/anchor/anchor.sh > "$OUT/anchor_usage.log" 2>&1; echo "=== anchor script: $(head -c 60 "$OUT/anchor_usage.log")"
      part pallas 300 python3 -m pytest -q tests/pallas/test_rows.py tests/pallas/test_trace_summary.py \
        tests/pallas/test_gpu_flags.py tests/pallas/test_program_structure.py -k "not hlo_loops"
      part kernels 120 python3 experiments/bench_kernels.py --small --lower cuda \
        --only head,moe_variants,prefill,formats,sweep_planar --out "$OUT/kernels.json"
    fi
    if [ "$MODE" = run ]; then
      # which op makes the 1.5B programs compile for ~70 s (2026-12-02: neither the layer count nor autotuning)
      part probe ${PROBE_S:-300} python3 experiments/compile_probe.py --geometry $MODEL --n_layer ${PROBE_LAYERS:-28} \
        --kinds prefill,step --ops none,all,quant_matmul,rows,qsa --jobs 4 --timeout 140 --out "$OUT/probe.json"
      part shapes ${SHAPES_S:-120} python3 experiments/compile_repeat.py --gguf $MODEL --families bytes,planar \
        --out "$OUT/shapes.json"
      part compile_repeat ${REPEAT_S:-120} python3 experiments/compile_repeat.py --out "$OUT/compile_repeat.json"
      part sampler ${SAMPLER_S:-150} python3 experiments/compile_sampler.py --timeout 60
      part decode_stacked ${DECODE_S:-200} $NEW STRATA_STACK_LAYERS=1 STRATA_QMATMUL=${GEN_QMATMUL:-planar} \
        python3 experiments/bench_decode.py --model $MODEL --prompt_tokens 64 --decode_tokens 32 \
        --out "$OUT/decode_stacked.json"
    fi
    # A/B of STRATA_* variants on the 1.5B file's decode steps (only when named in PARTS, with AB_VARIANTS set:
    # "NAME:VAR=v ...;NAME2:..." against the defaults; one engine, each variant recompiled, rounds alternating)
    if [[ " $PARTS " == *" ab_steps "* ]]; then
      if [ -z "${AB_VARIANTS:-}" ]; then echo "=== ab_steps skipped: AB_VARIANTS not set"; else
      part ab_steps ${AB_S:-240} $NEW python3 experiments/profile_step.py --model $MODEL --kind steps --decode_steps 4 \
        --steps ${AB_STEPS:-40} --warmup 3 --prompt_tokens 64 --command_buffers 1 --ab_rounds ${AB_ROUNDS:-2} \
        --ab "$AB_VARIANTS" --out "$OUT/ab_steps.json"; fi
    fi
    part decode_new ${DECODE_S:-200} $NEW python3 experiments/bench_decode.py --model $MODEL --prompt_tokens 64 \
      --decode_tokens 64 --decode_steps ${DECODE_STEPS:-2,4,8} --out "$OUT/decode_new.json"
    part decode_noplanes ${DECODE_S:-200} $NEW STRATA_QMATMUL_PLANES=0 python3 experiments/bench_decode.py \
      --model $MODEL --prompt_tokens 64 --decode_tokens 64 --decode_steps ${DECODE_STEPS:-2,4,8} \
      --out "$OUT/decode_noplanes.json"
    if [ "$MODE" = run ]; then
      part decode_bytes 80 $NEW STRATA_QMATMUL=bytes python3 experiments/bench_decode.py --model $MODEL \
        --prompt_tokens 64 --decode_tokens 32 --out "$OUT/decode_bytes.json"
      part decode_unshared 80 $NEW STRATA_QMATMUL_SHARED=0 python3 experiments/bench_decode.py --model $MODEL \
        --prompt_tokens 64 --decode_tokens 32 --out "$OUT/decode_unshared.json"
    fi
    PREFILL_S=${PREFILL_S:-150}; PB=$(left); [ "$PB" -gt "$PREFILL_S" ] && PB=$PREFILL_S  # the part's own limit
    if [ "$MODE" = run ]; then PF="--prompts ${PREFILL_PROMPTS:-512,2048,8192} --chunks ${PREFILL_CHUNKS:-128,256,512}"
    else PF="--prompts 40,100 --chunks 16,32 --max_context 128"; fi
    part prefill "$PREFILL_S" $NEW python3 experiments/bench_prefill.py --model $MODEL $PF --repeats 2 \
      --budget_s $(( PB - 15 )) --out "$OUT/prefill.json"
    IDS=$(python3 -c "print(','.join(str(1 + 37 * i % 500) for i in range(64)))")
    part generate ${GENERATE_S:-150} $NEW STRATA_QMATMUL=${GEN_QMATMUL:-planar} python3 -m strata_jax.cli.generate --model $MODEL --prompt_ids "$IDS" \
      --max_new_tokens 128 --stats_json "$OUT/generate.json"
    # a cold start of the user path (an empty XLA cache each run): the decode program compiled beside the prefill
    # (CompileCache.ahead, the default) against one after the other (STRATA_COMPILE_AHEAD=0), alternating
    [[ " $PARTS " == *" cold_ab "* ]] && for r in 1 2; do for V in 1 0; do
      rm -rf /tmp/cold_xla
      PARTS="$PARTS cold_ab_${V}_$r" part cold_ab_${V}_$r ${COLD_S:-90} env -u JAX_COMPILATION_CACHE_DIR \
        STRATA_COMPILE_AHEAD=$V $NEW python3 -m strata_jax.cli.generate --model $MODEL --prompt_ids "$IDS" \
        --max_new_tokens 64 --max_context 1024 --xla_cache_dir /tmp/cold_xla --stats_json "$OUT/cold_ab_${V}_$r.json"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f'    cold_ab ahead={sys.argv[2]} round {sys.argv[3]}: built {r[\"compiles\"]} functions in {r[\"compile_seconds\"]:.1f} s, prefill {r[\"prefill_seconds\"]:.1f} s, compiled ahead {r[\"compiled_ahead\"]}, tokens {r[\"tokens\"][:6]}')" \
        "$OUT/cold_ab_${V}_$r.json" $V $r 2>/dev/null
    done; done
    # the user path at bench_decode's --max_context (1024; strata-generate's default is 4096)
    part generate_1k ${GENERATE_S:-150} $NEW python3 -m strata_jax.cli.generate --model $MODEL --prompt_ids "$IDS" \
      --max_new_tokens 128 --max_context 1024 --stats_json "$OUT/generate_1k.json"
    part generate_1k_noplanes ${GENERATE_S:-150} $NEW STRATA_QMATMUL_PLANES=0 python3 -m strata_jax.cli.generate \
      --model $MODEL --prompt_ids "$IDS" --max_new_tokens 128 --max_context 1024 \
      --stats_json "$OUT/generate_1k_noplanes.json"
    # --decode_steps N gives the tokens of one step per call: greedy and seeded, 1 vs 4 (and 8) steps per call
    steps_exact() {
      for samp in "--temperature 0" "--temperature 0.8 --top_k 40 --seed 7"; do
        for n in 1 4 8; do
          $NEW python3 -m strata_jax.cli.generate --model $MODEL --prompt_ids "$IDS" --max_new_tokens 61 \
            --max_context 1024 $samp --decode_steps $n --stats_json "$OUT/steps_$n.json" > /dev/null 2>&1 || return 1
        done
        python3 -c "
import json,sys; t=[json.load(open(f'$OUT/steps_{n}.json'))['tokens'] for n in (1,4,8)]
r=[json.load(open(f'$OUT/steps_{n}.json'))['decode_tok_s'] for n in (1,4,8)]
print('$samp:', 'same tokens' if t[0]==t[1]==t[2] else 'MISMATCH', len(t[0]), 'tokens; tok/s at 1/4/8 steps:', r)
sys.exit(0 if t[0]==t[1]==t[2] else 1)" || return 1
      done
    }
    export MODEL IDS OUT NEW; export -f steps_exact
    part steps_exact ${GENERATE_S:-150} bash -c steps_exact
    # batch slots, aggregate decode: --batch N over N requests of 128 tokens (64-token prompts), side by side
    # with llama-batched-bench's S_TG at the same stream counts (part anchor_batched)
    batch_gen() {
      for n in ${BATCH_NS:-2 4 8}; do
        python3 -c "import json
for r in range($n): print(json.dumps({'prompt_ids': [1 + (37 * i + 11 * r) % 500 for i in range(64)], 'max_new_tokens': 128}))" \
          > "$OUT/prompts_$n.jsonl"
        $NEW python3 -m strata_jax.cli.generate --model $MODEL --batch $n --prompts_file "$OUT/prompts_$n.jsonl" \
          --max_context 1024 --stats_json "$OUT/batch_$n.json" > "$OUT/batch_$n.log" 2>&1 || { tail -3 "$OUT/batch_$n.log"; return 1; }
        python3 -c "import json; d = json.load(open('$OUT/batch_$n.json')); print('batch $n: %.1f tok/s aggregate (%s step programs)' % (d['tok_s'] or 0, d.get('step_programs')))"
      done
    }
    export -f batch_gen; export BATCH_NS
    part batch_gen ${BATCH_S:-200} bash -c batch_gen
    if [ "$MODE" = run ]; then
      part anchor_batched 120 env WAIT_S=${WAIT_S:-480} bash .carry/anchor/anchor.sh batched $MODEL
    fi
    if [ "$MODE" = run ]; then  # the Qwen3.8-Flash-Next shape on one GPU (random weights made on the device)
      part fullsize ${FULL_S:-300} $NEW ${FULL_ENV:-} python3 experiments/bench_fullsize.py --geometry qwen3.8-flash-next \
        --devices 1 ${FULL_LAYERS:+--n_layer $FULL_LAYERS} --decode_steps ${FULL_STEPS:-4} --out "$OUT/fullsize.json"
      # the same on the old package (.carry/old, BASE): before / after in one call on one card
      part fullsize_old ${FULL_S:-300} $OLD ${FULL_ENV:-} python3 experiments/bench_fullsize.py --geometry qwen3.8-flash-next \
        --devices 1 ${FULL_LAYERS:+--n_layer $FULL_LAYERS} --decode_steps ${FULL_STEPS:-4} --out "$OUT/fullsize_old.json"
    fi
    # the real file path at full size: a Flash-Next-shape GGUF written here (random blocks), loaded through
    # strata-generate --model FILE (memory map; load seconds, device memory, decode tok/s in its --stats_json); only
    # when named in PARTS (PARTS=all leaves them out: they need 54 GB of disk and most of a call)
    if [ "$MODE" = run ] && [[ " $PARTS " == *" realfile_"* ]]; then
      REAL=/tmp/flash.gguf
      realfile_write() {
        if [ -s $REAL ] && [ "${REAL_REWRITE:-0}" = 0 ]; then
          echo "reusing $REAL ($(stat -c %s $REAL) bytes, written by an earlier call; REAL_REWRITE=1 writes it again)"; return 0
        fi
        local need=$(( ${REAL_LAYERS:-48} * 1091 + 1230 )) free  # MB: 1.09 GB per layer + embeddings, head, PLE table
        free=$(df --output=avail -B 1000000 /tmp | tail -n 1)
        echo "about $need MB to write, $free MB free in /tmp"
        [ "$free" -gt $(( need + 2000 )) ] || { echo "not enough disk for $REAL"; return 1; }
        local t0; t0=$(date +%s)
        python3 .carry/tools/make_qwen4exp_gguf.py $REAL.partial ${REAL_LAYERS:-48} || return 1
        mv $REAL.partial $REAL
        echo "wrote $REAL: $(stat -c %s $REAL) bytes, ${REAL_LAYERS:-48} layers, in $(( $(date +%s) - t0 )) s"
      }
      export REAL REAL_LAYERS REAL_REWRITE; export -f realfile_write
      part realfile_write ${REALFILE_S:-300} bash -c realfile_write
      part realfile_generate ${REALFILE_S:-300} $NEW python3 -m strata_jax.cli.generate --model $REAL --prompt_ids "$IDS" \
        --max_new_tokens 64 --stats_json "$OUT/realfile_generate.json"
      if want realfile_batch; then  # 4 requests of 64-token prompts, 64 tokens each, in 4 slots of 8192 cells
        python3 -c "import json
for r in range(4): print(json.dumps({'prompt_ids': [1 + (37 * i + 11 * r) % 500 for i in range(64)], 'max_new_tokens': 64}))" \
          > "$OUT/realfile_prompts.jsonl"
      fi
      part realfile_batch ${REALFILE_S:-300} $NEW python3 -m strata_jax.cli.generate --model $REAL --batch 4 \
        --prompts_file "$OUT/realfile_prompts.jsonl" --max_context 8192 --stats_json "$OUT/realfile_batch.json"
      # issue 14's second goal: a slot decoding (64-token prompt, LONGREAD_NEW tokens, default 2,500: ~18 s at 136
      # tok/s) while an 8,192-token prompt arrives (LONGREAD_AT s after the scheduler starts, default 5; a compile
      # before it only delays the admission) and is read beside it in --batch 2 (the summary's "decode beside prompt
      # reads", steps that compiled left out, against the solo rate of realfile_generate; the prompt's TTFT)
      if want realfile_longread; then
        python3 -c "import json
print(json.dumps({'prompt_ids': [1 + 37 * i % 500 for i in range(64)], 'max_new_tokens': ${LONGREAD_NEW:-2500}}))
print(json.dumps({'prompt_ids': [1 + (53 * i + 7) % 9000 for i in range(8192)], 'max_new_tokens': 16, 'arrival': ${LONGREAD_AT:-5}}))" \
          > "$OUT/realfile_longread.jsonl"
      fi
      part realfile_longread ${REALFILE_S:-300} $NEW python3 -m strata_jax.cli.generate --model $REAL --batch 2 \
        --prompts_file "$OUT/realfile_longread.jsonl" --max_context 8448 --stats_json "$OUT/realfile_longread.json" \
        ${LONGREAD_SHARE:+--batch_read_share $LONGREAD_SHARE}
      # the same at other --batch_read_share values (LONGREAD_SHARES, e.g. "1 0.3"; the XLA cache of the run above
      # makes these compile nothing), one part each: realfile_longread_<share>
      for sh in ${LONGREAD_SHARES:-}; do
        want realfile_longread && PARTS="$PARTS realfile_longread_$sh" part realfile_longread_$sh ${REALFILE_S:-300} \
          $NEW python3 -m strata_jax.cli.generate --model $REAL --batch 2 --prompts_file "$OUT/realfile_longread.jsonl" \
          --max_context 8448 --batch_read_share $sh --stats_json "$OUT/realfile_longread_$sh.json"
      done
      # prompt reading on the same file (issue 14's Flash-Next ratio): REAL_PROMPTS in chunks of REAL_CHUNKS
      part realfile_prefill ${REALFILE_S:-300} $NEW python3 experiments/bench_prefill.py --model $REAL \
        --prompts ${REAL_PROMPTS:-512,2048} --chunks ${REAL_CHUNKS:-512} --repeats 2 --budget_s $(( ${REALFILE_S:-300} - 20 )) \
        --out "$OUT/realfile_prefill.json"
      part realfile_anchor ${REALFILE_S:-300} env REPS=2 bash .carry/anchor/anchor.sh bench $REAL
    fi
    # issue 12 item 5: every function of the full-size Flash-Next model compiled cold (an empty XLA cache of its
    # own), weights abstract (compile_probe.py), quantized-matmul kernels on; COMPILE_JOBS compiles at once
    if [ "$MODE" = run ]; then
      part compile_full ${COMPILE_S:-300} env JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache_cold_$T0 python3 \
        experiments/compile_probe.py --geometry qwen3.8-flash-next --n_layer 48 --ops all --jobs ${COMPILE_JOBS:-3} \
        --kinds ${COMPILE_KINDS:-prefill,step,window2,window3,window4,window5,window6,window7,window8,mtp_prefill,mtp_window4} \
        --timeout ${COMPILE_TIMEOUT:-150} --out "$OUT/compile_full.json"
    fi
    if [ -n "${EX_PIDS:-}" ]; then  # the exactness processes started before the pallas part
      echo "=== exactness: waiting ($(date +%T), $(left) s left)"; wait $EX_PIDS
      for f in "$OUT"/exact_*.log; do echo "    $(basename $f .log): $(grep -E '^(serial|pipelined|batch_mtp|piped_mtp) |resolves|ALL EXACT|MISMATCHES' $f | tr '\n' ' ' | cut -c1-220)"; done
    fi
    # generate_1k again after the parts above (with ANCHOR_WAIT_EARLY=0: once the llama.cpp build is done)
    part generate_1k_late ${GENERATE_S:-150} $NEW python3 -m strata_jax.cli.generate --model $MODEL --prompt_ids "$IDS" \
      --max_new_tokens 128 --max_context 1024 --stats_json "$OUT/generate_1k_late.json"
    part profile_new 100 $NEW python3 experiments/profile_step.py --model $MODEL $PROF --out "$OUT/profile_new.json"
    # the same step at strata-generate's default context (4096 cells; bench_decode's is 1024)
    part profile_4k 100 $NEW python3 experiments/profile_step.py --model $MODEL $PROF --max_context 4096 \
      --out "$OUT/profile_4k.json"
    # the GPU's default decode loop: 4 steps per program (run_steps), CUDA graphs kept in the trace, figures per
    # token, the program's HLO beside it (the fusions the trace names)
    part profile_steps 120 $NEW python3 experiments/profile_step.py --model $MODEL --kind steps --decode_steps 4 \
      --steps 16 --warmup 2 --prompt_tokens 64 --command_buffers 1 --graphs_in_trace 1 --hlo_launches 0 --top 80 \
      --ple_table device \
      --hlo_out "$OUT/steps_hlo.txt" --out "$OUT/profile_steps.json"
    if [ "$MODE" = run ]; then  # the same on the Qwen3.8-Flash-Next shape (random weights, PLE table on the device)
      part profile_full_steps ${FULL_PROFILE_S:-240} $NEW python3 experiments/profile_step.py \
        --geometry qwen3.8-flash-next ${FULL_LAYERS:+--n_layer $FULL_LAYERS} --kind steps --decode_steps ${FULL_PROFILE_STEPS:-4} --steps 6 --warmup 1 \
        --prompt_tokens 16 --command_buffers ${FULL_STEPS_CB:-1} --graphs_in_trace 1 --hlo_launches 0 --top 80 --ple_table device \
        --hlo_out "$OUT/full_steps_hlo.txt" --out "$OUT/profile_full_steps.json"
      # A/B of trace-time switches on one Flash-Next engine (AB_VARIANTS, profile_step.py --ab): decode steps with
      # command buffers on, each variant recompiled, rounds alternating; ms per token and the ratio to the default
      if want ab_full_steps && [ -z "${AB_VARIANTS:-}" ]; then echo "=== ab_full_steps skipped: AB_VARIANTS not set"; else
      part ab_full_steps ${AB_S:-240} $NEW python3 experiments/profile_step.py --geometry qwen3.8-flash-next \
        ${FULL_LAYERS:+--n_layer $FULL_LAYERS} --kind steps --decode_steps 4 --steps ${AB_STEPS:-40} --warmup 3 \
        --prompt_tokens 16 --max_context 4096 --command_buffers 1 --ple_table device --ab_rounds ${AB_ROUNDS:-2} \
        --ab "${AB_VARIANTS:-}" --out "$OUT/ab_full_steps.json"; fi
      if [[ " $PARTS " == *" xla_ab "* ]] && [ -z "${XLA_AB:-}" ]; then echo "=== xla_ab skipped: XLA_AB not set"
      elif [[ " $PARTS " == *" xla_ab "* ]]; then
        for r in $(seq 1 ${XLA_AB_ROUNDS:-2}); do
          VS="base:;${XLA_AB:-}"; [ $((r % 2)) = 0 ] && VS=$(echo "$VS" | tr ';' '\n' | tac | paste -sd';')
          IFS=';' read -ra VA <<< "$VS"
          for v in "${VA[@]}"; do
            [ -z "$v" ] && continue
            vn=${v%%:*}; vf=${v#*:}
            PARTS="$PARTS xla_ab_${vn}_$r" part xla_ab_${vn}_$r ${XLA_AB_S:-150} env XLA_FLAGS="$vf" $NEW python3 experiments/profile_step.py \
              --geometry qwen3.8-flash-next --n_layer ${FULL_LAYERS:-16} --kind steps --decode_steps 4 --steps 30 \
              --warmup 3 --prompt_tokens 16 --max_context 1024 --command_buffers 1 --graphs_in_trace 1 \
              --hlo_launches 0 --top 20 --ple_table device --out "$OUT/xla_ab_${vn}_$r.json"
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f'    xla_ab {sys.argv[2]:10s} round {sys.argv[3]}: {r[\"wall_ms\"]:.3f} ms/token, traced {r[\"traced_wall_ms\"]:.3f}, busy {r[\"busy_fraction\"]:.2f}, first call {r[\"first_step_s\"]:.1f} s')" \
              "$OUT/xla_ab_${vn}_$r.json" "$vn" "$r" 2>/dev/null
          done
        done
      fi
      # where a full-size Flash-Next program's cold compile goes (issue 12 item 5): abstract weights, the engine's XLA
      # flags, no persistent cache, XLA's own trace events of the compile by name (compile_probe --profile_top)
      part compile_steps ${COMPILE_S:-300} env -u JAX_COMPILATION_CACHE_DIR XLA_FLAGS="$FLAGS" python3 \
        experiments/compile_probe.py --geometry qwen3.8-flash-next --n_layer ${COMPILE_LAYERS:-48} \
        --kinds ${COMPILE_KINDS:-steps4x4} --ops all --timeout $(( ${COMPILE_S:-300} - 20 )) --profile_top 30 \
        ${COMPILE_XLA:+--xla_variants "$COMPILE_XLA"} --out "$OUT/compile_steps.json"
      # one Flash-Next prefill chunk (the engine's 512 rows at the start of a 1,024-cell context), the new tree and
      # the old package (.carry/old, BASE) in one call: kernel times per chunk (command buffers kept in the trace)
      for V in new old; do
        [ $V = new ] && PP="$NEW" || PP="$OLD"
        part profile_full_prefill_$V ${FULL_PROFILE_S:-240} $PP python3 experiments/profile_step.py \
          --geometry qwen3.8-flash-next ${FULL_LAYERS:+--n_layer $FULL_LAYERS} --kind prefill --steps 4 --warmup 1 \
          --prompt_tokens 16 --command_buffers 1 --graphs_in_trace 1 --hlo_launches 0 --top 40 ${FULL_PREFILL_ARGS:-} \
          --out "$OUT/profile_full_prefill_$V.json"
      done
    fi
    # the step as users run it: CUDA graphs kept in the trace; host events; where the compiled launches sit
    part profile_cb 100 $NEW python3 experiments/profile_step.py --model $MODEL $PROF --command_buffers 1 \
      --graphs_in_trace 1 --out "$OUT/profile_cb.json"
    # command-buffer updates: XLA re-records every graph node whose buffer address changed since the last run
    # (xla_gpu_command_buffer_update_mode picks whether temporaries get stable addresses; its values differ
    # between XLA versions, so the accepted ones are probed first), with VLOG lines counting the updates
    if want cb_modes && [ "$MODE" = run ]; then
      : > "$OUT/cb_modes.txt"
      for v in VMM_PERSISTENT_TEMP NEVER_UPDATE SKIP_TEMP CAPTURE_CMD_NEVER_UPDATE; do
        if XLA_FLAGS="--xla_gpu_command_buffer_update_mode=$v" timeout 60 python3 -c \
            "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: x + 1)(jnp.ones(3))[0]))" \
            > "$OUT/cb_flag_$v.log" 2>&1; then echo "$v" >> "$OUT/cb_modes.txt"; fi
      done
      echo "=== update modes accepted: $(tr '\n' ' ' < "$OUT/cb_modes.txt")"
      part cb_vlog 100 env TF_CPP_MIN_LOG_LEVEL=0 \
        TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,command_buffer_cmd=1 $NEW python3 \
        experiments/profile_step.py --model $MODEL --steps 6 --warmup 3 --prompt_tokens 64 --command_buffers 1 \
        --hlo_launches 0 --out "$OUT/cb_vlog.json"
      grep -E "updated_allocs=|Updated [0-9]+ commands" "$OUT/cb_vlog.log" | tail -n 6 | cut -c1-300 | sed 's/^/    /'
      for v in $(cat "$OUT/cb_modes.txt"); do
        part "profile_cb_$v" 100 env XLA_FLAGS="--xla_gpu_command_buffer_update_mode=$v" TF_CPP_MIN_LOG_LEVEL=0 \
          TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,command_buffer_cmd=1 $NEW python3 \
          experiments/profile_step.py --model $MODEL $PROF --command_buffers 1 --graphs_in_trace 1 --hlo_launches 0 \
          --out "$OUT/profile_cb_$v.json"
        grep -E "updated_allocs=|Updated [0-9]+ commands" "$OUT/profile_cb_$v.log" | tail -n 3 | cut -c1-300 | sed 's/^/    /'
      done
      CBM=${CBM:-$(head -n 1 "$OUT/cb_modes.txt")}
      if [ -n "$CBM" ]; then  # the bench and the user path under the first accepted mode
        part decode_cbm ${DECODE_S:-200} env XLA_FLAGS="--xla_gpu_command_buffer_update_mode=$CBM" $NEW python3 \
          experiments/bench_decode.py --model $MODEL --prompt_tokens 64 --decode_tokens 64 --out "$OUT/decode_cbm.json"
        part generate_cbm ${GENERATE_S:-150} env XLA_FLAGS="--xla_gpu_command_buffer_update_mode=$CBM" $NEW python3 \
          -m strata_jax.cli.generate --model $MODEL --prompt_ids "$IDS" --max_new_tokens 128 --max_context 1024 \
          --stats_json "$OUT/generate_cbm.json"
      fi
    fi
    part profile_prefill 100 $NEW python3 experiments/profile_step.py --model $MODEL --kind prefill --steps 5 --warmup 2 \
      --prompt_tokens 16 --out "$OUT/profile_prefill.json"
    if [ "$MODE" = run ]; then
      part anchor ${ANCHOR_S:-100} bash .carry/anchor/anchor.sh bench $MODEL
    fi
    part profile_old 90 $OLD python3 experiments/profile_step.py --model $MODEL $PROF --hlo_launches 0 --out "$OUT/profile_old.json"
    python3 - "$OUT" <<'EOF'
import json, os, re, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None
print(f"{'path':28s} {'ms/step':>8s} {'tok/s':>7s} {'busy':>5s} {'launches':>8s} {'D2H/step':>9s} {'D2D/step':>16s}")
for label, name in (("old (base package)", "profile_old.json"), ("new (kernels, per layer)", "profile_new.json"),
                    ("4 steps/program, per token", "profile_steps.json"),
                    ("Flash-Next, steps, per token", "profile_full_steps.json"),
                    ("new, --max_context 4096", "profile_4k.json"),
                    ("new, command buffers on", "profile_cb.json")) + tuple(
        (f"cb, update mode {v}", f"profile_cb_{v}.json") for v in (open(os.path.join(out, "cb_modes.txt")).read().split()
                                                                    if os.path.exists(os.path.join(out, "cb_modes.txt")) else [])):
    r = load(name)
    if r is None:
        print(f"{label:28s} (no result: see {name[:-5]}.log)")
        continue
    c = r["trace"]["copies"]
    d2d = c.get("D2D", {"count": 0, "bytes": 0})
    print(f"{label[:28]:28s} {r['wall_ms']:8.2f} {1e3 / r['wall_ms']:7.1f} {r['busy_fraction'] or 0:5.2f} "
          f"{r['trace']['launches']:8.0f} {c.get('D2H', {}).get('count', 0):9.1f} "
          f"{d2d['count']:6.1f} {d2d['bytes'] / 1e6:7.2f} MB")
    hl = r.get("hlo_launches")
    if hl:
        print(f"  {'':26s} compiled: {hl['graphs']} command-buffer calls, {sum(hl['in_graphs'].values())} launches "
              f"in graphs, {sum(hl['outside'].values())} alone {dict(sorted(hl['outside'].items(), key=lambda kv: -kv[1])[:4])}")
for label, name in (("new, default kernels (planar)", "decode_new.json"),
                    ("new, GEMV plane path off (STRATA_QMATMUL_PLANES=0)", "decode_noplanes.json"),
                    ("new, STRATA_QMATMUL=bytes", "decode_bytes.json"),
                    ("new, one launch per matrix (STRATA_QMATMUL_SHARED=0)", "decode_unshared.json"),
                    ("new, layers stacked (STRATA_STACK_LAYERS=1)", "decode_stacked.json"),
                    ("new, first accepted command-buffer update mode", "decode_cbm.json")):
    d = load(name)
    if d:
        print(f"bench_decode ({label}, command buffers on): decode {d['decode_tok_s']:.1f} tok/s, prefill "
              f"{d['prefill_tok_s']:.1f} tok/s, {d['fraction_of_ceiling']:.3f} of the ceiling")
for label, name in (("", "generate.json"), (", --max_context 1024", "generate_1k.json"),
                    (", --max_context 1024, plane path off", "generate_1k_noplanes.json"),
                    (", --max_context 1024, after the other parts", "generate_1k_late.json"),
                    (", --max_context 1024, first accepted update mode", "generate_cbm.json")):
    g = load(name)
    if g:
        print(f"strata-generate (user path, 1 stream{label}): decode {g.get('decode_tok_s') or 0:.1f} tok/s, prefill "
              f"{g.get('prefill_tok_s') or 0:.1f} tok/s, load {g.get('load_seconds') or 0:.1f} s, "
              f"{g.get('compiles')} compiles in {g.get('compile_seconds') or 0:.1f} s")
f = load("fullsize.json")
if f:
    print("Flash-Next shape, 1 GPU: " + json.dumps({k: v for k, v in f.items() if not isinstance(v, (dict, list))})[:400])
try:
    print("real file: " + [ln.strip() for ln in open(os.path.join(out, "realfile_write.log"))
                           if ln.startswith(("wrote", "reusing"))][-1])
except (OSError, IndexError):
    pass
for label, name, rate in (("1 stream", "realfile_generate.json", "decode_tok_s"),
                          ("--batch 4 x 8192 cells, aggregate", "realfile_batch.json", "tok_s"),
                          ("--batch 2, an 8K prompt read beside a decoding slot", "realfile_longread.json", "tok_s")):
    g = load(name)
    if g:
        m = g.get("memory") or {}
        mem = (f"{m.get('source')} memory {(m.get('bytes_in_use') or 0) / 2**30:.1f} GiB in use, peak "
               f"{(m.get('peak_bytes_in_use') or 0) / 2**30:.1f} of {(m.get('bytes_limit') or 0) / 2**30:.1f} GiB")
        print(f"strata-generate (real file, {label}): decode {g.get(rate) or 0:.1f} tok/s, load "
              f"{g.get('load_seconds') or 0:.1f} s, {mem}, {g.get('compiles')} compiles in "
              f"{g.get('compile_seconds') or 0:.1f} s")
g = load("realfile_longread.json")
if g:
    solo = (load("realfile_generate.json") or {}).get("decode_tok_s")
    beside = g.get("decode_beside_prefill_tok_s")
    print(f"  decode beside the 8K read: {beside or 0:.1f} tok/s"
          + (f" ({beside / solo:.2f} of the 1-stream rate {solo:.1f})" if beside and solo else "")
          + f"; time to first token {json.dumps(g.get('ttft_s'))}")
try:
    for ln in open(os.path.join(out, "realfile_anchor.log")):
        if re.search(r"\| +(tg|pp)\d+", ln):
            print("llama.cpp (real file) " + " ".join(ln.split()))
except OSError:
    pass
k = load("kernels.json")
if k and k.get("summary"):
    print(f"kernels (fraction of the {k.get('ceiling_GBps') or 0:.0f} GB/s ceiling; {len(k.get('skipped', []))} cases "
          f"over budget):")
    for r in k["summary"]:
        rest = " ".join(f"{p}={v:.2f}" for p, v in r.items() if p not in ("op", "case", "best", "best_frac"))
        print(f"  {r['op']:<12} {r['case']:<38} {rest}")
try:
    rows = [ln for ln in open(os.path.join(out, "anchor.log")) if re.search(r"\| +(tg|pp)\d+", ln)]
    for ln in rows:
        print("llama.cpp " + " ".join(ln.split()))
except OSError:
    rows = []
p = load("realfile_prefill.json")
if p:
    print("real file, prefill (bench_prefill.py):")
    for ln in p.get("table", []):
        print("  " + ln)
p = load("prefill.json")
if p:
    for ln in p.get("table", []):
        print(ln)
    pp = [float(m.group(1)) for ln in rows for m in [re.search(r"\|\s*pp512\s*\|\s*([\d.]+)", ln)] if m]
    r512 = [c for c in p.get("cases", []) if c["prompt"] == 512]
    if pp and r512 and not p.get("llamacpp_pp512"):
        best = max(r512, key=lambda c: c["tok_s"])
        print(f"prefill vs llama.cpp pp512 {pp[0]:.0f} tok/s: best 512-token prefill {best['tok_s']:.1f} tok/s "
              f"(chunk {best['chunk']}) = {best['tok_s'] / pp[0]:.3f} of it")
EOF
    # the device tool returns a handful of files: everything but this log goes back in one archive
    # (tar's status is ignored: a file still written by a part killed at its timeout made it 1 on 2026-12-02)
    tar czf "$OUT/parts.tgz" -C "$OUT" --exclude=parts.tgz --exclude=session.log . 2>/dev/null
    [ -s "$OUT/parts.tgz" ] && find "$OUT" -type f ! -name parts.tgz ! -name session.log -delete
    ;;
  *) sed -n 2,18p "$0"; exit 2;;
esac
