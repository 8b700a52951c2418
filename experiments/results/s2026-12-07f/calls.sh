#!/bin/bash
# The device calls of 2026-12-07 (sixth session), in order, on one H100 lease (after eight refused starts).
# Here first: BASE=049af54 bash experiments/device_session.sh prepare; every call carries [".carry"].
# Logs: experiments/results/h100_2026-12-07f/call<N>/.
case "$1" in
  1) TOTAL=590 bash experiments/results/s2026-12-07f/call2.sh ;;   # compiled f16 tile tests, llama build, xla_ab, 1.5B prefill
  2) TOTAL=320 bash experiments/results/s2026-12-07f/call3.sh ;;   # cold_ab (compile ahead), xla_ab 8 layers
  *) echo "usage: $0 1|2" >&2; exit 2 ;;
esac
