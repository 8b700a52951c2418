# Sourced by the device call scripts (experiments/results/s*/call*.sh): one call split into sub-runs of
# experiments/device_session.sh, each with its own $OUT/<name>/ (session.log, parts.tgz) and time budget, cut to
# what is left of the call's TOTAL seconds (set TOTAL before sourcing; the call's start is when this is sourced).
#   run NAME SECONDS [VAR=value ...]: `device_session.sh run` with those variables, its log's last 30 lines
#   left: seconds left of TOTAL
T0=$(date +%s)
TOTAL=${TOTAL:-570}
OUT0=${OUT:-/tmp/out}
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
run() { local sub=$1 b=$2; shift 2; local l; l=$(left); [ "$b" -gt "$l" ] && b=$l
  [ "$b" -lt 30 ] && { echo "=== $sub skipped ($l s left)"; return; }
  echo "##### $sub (budget $b s)"
  env OUT=$OUT0/$sub BUDGET=$b "$@" bash experiments/device_session.sh run 2>&1 | grep -v "^\s*$" \
    | grep -v "Target directory" | grep -v "no result: see" | tail -n 30; }
