#!/bin/bash
# 2026-12-07 (fourth session), call 4 (run as one command on call 1's warm machine): the 48-layer 4-slot steps
# program's cold compile (compile_probe kind steps4x4, XLA's trace events by name; issue 12 item 5).
#   device run (carry [".carry"]): bash experiments/results/s2026-12-07d/call4.sh
OUT=${OUT:-/tmp/out} BUDGET=230 PARTS="env compile_steps" COMPILE_S=220 bash experiments/device_session.sh run 2>&1 | tail -40
