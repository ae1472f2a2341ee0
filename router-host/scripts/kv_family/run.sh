#!/usr/bin/env bash
# The tight-KV workload family on real vLLM engines (live.py; README.md beside this file).
# Every argument goes to live.py (--help lists them). This wrapper only makes sure nothing
# outlives the run: live.py stops its engines and routers itself, and when it is killed hard
# the process groups it listed are killed here, as live_bench/run.sh does.
#
#   router-host/scripts/kv_family/run.sh [--quick] [--runs N] [--workloads a,b] [--routers ...]
#
# Needs, as the live bench: the rig's venv and model (../vllm_rig/run.sh install), the peers'
# venv (../live_bench/run.sh installs it into ~/.cache/router-host-live-bench) and a release
# build of router-host and the two-tier plugin (cargo build --release -p router-host -p
# two-tier-cost-fn).
set -euo pipefail
export PYTHONDONTWRITEBYTECODE=1

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${ROUTER_BENCH_PYTHON:-python3}"

PGIDS="$(mktemp "${TMPDIR:-/tmp}/kv-family-pgids.XXXXXX")"
export LIVE_BENCH_PGIDS="$PGIDS"
CHILD=""
cleanup() {
  local status=$?
  if [ -n "$CHILD" ]; then
    kill -TERM "$CHILD" 2>/dev/null || true
    wait "$CHILD" 2>/dev/null || true
  fi
  while read -r pgid; do
    if [ -n "$pgid" ]; then kill -KILL -- "-$pgid" 2>/dev/null || true; fi
  done < "$PGIDS"
  rm -f "$PGIDS"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# In the background, so that a signal to this script is handled at once (bash runs traps only
# between commands; `wait` is one).
"$PYTHON" "$HERE/live.py" "$@" &
CHILD=$!
status=0
wait "$CHILD" || status=$?
CHILD=""
exit "$status"
