#!/bin/bash
# The device calls of 2026-12-07 (fifth session), in order: calls 1-4 on one H100 lease, 5 and 6 on fresh H100s.
# Here first: BASE=049af54 bash experiments/device_session.sh prepare; every call carries [".carry"].
# Logs: experiments/results/h100_2026-12-07e/call<N>/.
case "$1" in
  1) TOTAL=560 bash experiments/results/s2026-12-07d/next1.sh ;;   # compiled tests, GEMV sweep 1/2/8 rows, compile
  2) TOTAL=570 bash experiments/results/s2026-12-07d/next2.sh ;;   # 48-layer file: generate, prefill, llama-bench
  3) PARTS="env exactness" EX_REQ=32 EX_NEW=512 timeout 420 bash experiments/device_session.sh run ;;   # batch_exactness
  4) PARTS="env random_gguf kernels" KERNELS_ONLY=prefill,moe_prefill timeout 380 bash experiments/device_session.sh run ;;
  5) PARTS="env kernels" KERNELS_ONLY=f16_sweep KERNELS_S=310 timeout 340 bash experiments/device_session.sh run ;;
  6) bash experiments/results/s2026-12-07e/call6.sh ;;   # after BASE=a2456ff ... prepare: compiled tests, 1.5B A/B
  *) echo "usage: $0 1|2|3|4|5|6" >&2; exit 2 ;;
esac
