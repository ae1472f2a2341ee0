#!/usr/bin/env bash
# The multi-replica benchmark: 1, 2 and 4 `router-host serve` replicas behind haproxy
# (round-robin, TCP) in front of 8 mock engines and one redis-server, a seeded multi-turn
# workload with shared tenant prefixes, with session bindings only versus bindings plus shared
# load, on 127.0.0.1. README.md beside this file says what is measured.
#
#   router-host/scripts/replicas_bench/run.sh [--quick] [--seed N] [--reps N] [--out DIR]
#                                             [-- DRIVER-FLAGS...]
#
#   --quick        a smoke run of a minute or two: 1 and 4 replicas, 1 repetition, 32 sessions,
#                  report to TARGET/replicas_bench/quick (not results/)
#   --seed N       seeds the workload (default 1)
#   --reps N       repetitions of every (replicas, mode) (default 2)
#   --out DIR      replicas.json and replicas.md (default: results/ beside this file)
#   -- FLAGS       passed to bench.py as they are (`python3 bench.py --help`)
#
# Exit 0 when every run completed with no failed request, 1 otherwise, 2 on bad usage.
#
# Environment:
#   CARGO_TARGET_DIR       honoured (default: the repository's target/); logs go to
#                          TARGET/replicas_bench/logs
#   ROUTER_CHAOS_CACHE     where a venv with PyYAML goes if python3 has none (as the chaos test)
set -euo pipefail
export PYTHONDONTWRITEBYTECODE=1

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
CACHE="${ROUTER_CHAOS_CACHE:-$HOME/.cache/router-host-chaos}"
PYYAML_VERSION=6.0.2

log() { printf '[replicas-bench %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
usage() { log "$*"; sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

QUICK=0
SEED=1
REPS=3
OUT=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --seed) [ $# -ge 2 ] || usage "--seed needs a number"; SEED="$2"; shift ;;
    --reps) [ $# -ge 2 ] || usage "--reps needs a number"; REPS="$2"; shift ;;
    --out) [ $# -ge 2 ] || usage "--out needs a directory"; OUT="$2"; shift ;;
    --) shift; EXTRA+=("$@"); break ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) usage "unknown argument \`$1\`" ;;
  esac
  shift
done
[[ "$SEED" =~ ^[0-9]+$ ]] || usage "--seed: a whole number, got \`$SEED\`"
[[ "$REPS" =~ ^[1-9][0-9]*$ ]] || usage "--reps: a whole number from 1, got \`$REPS\`"

TARGET="${CARGO_TARGET_DIR:-$REPO/target}"
case "$TARGET" in /*) ;; *) TARGET="$REPO/$TARGET" ;; esac
if [ -z "$OUT" ]; then
  if [ "$QUICK" = 1 ]; then OUT="$TARGET/replicas_bench/quick"; else OUT="$HERE/results"; fi
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOGS="$TARGET/replicas_bench/logs"
rm -rf "$LOGS"
mkdir -p "$LOGS"

# haproxy and redis-server from Debian, installed if missing; the driver is standard library
# Python but for PyYAML (the chaos test's venv outside the repository when python3 lacks it).
. "$HERE/../lib/setup.sh"
debian_packages haproxy redis-server
python_with_yaml "$CACHE" "$PYYAML_VERSION"

log "cargo build --release -p router-host -p two-tier-cost-fn"
t0=$SECONDS
(cd "$REPO" && cargo build --release -p router-host -p two-tier-cost-fn) || die "cargo build --release failed"
BIN="$TARGET/release/router-host"
PLUGIN="$TARGET/release/libtwo_tier_cost_fn.so"
[ -x "$BIN" ] || die "no $BIN after the build"
[ -f "$PLUGIN" ] || die "no $PLUGIN after the build"
log "build took $((SECONDS - t0)) s"

COMMAND="router-host/scripts/replicas_bench/run.sh --seed $SEED --reps $REPS"
ARGS=(--replicas 1,2,4 --reps "$REPS")
if [ "$QUICK" = 1 ]; then
  COMMAND="router-host/scripts/replicas_bench/run.sh --quick --seed $SEED"
  ARGS=(--replicas 1,4 --reps 1 --sessions 48)
fi
[ ${#EXTRA[@]} -eq 0 ] || COMMAND+=" -- ${EXTRA[*]}"

# exec: a signal to this script reaches the driver, which stops every process it started.
exec "$PYTHON" "$HERE/bench.py" --router-host "$BIN" --plugin "$PLUGIN" --seed "$SEED" --out "$OUT" \
  --logs "$LOGS" --command "$COMMAND" "${ARGS[@]}" "${EXTRA[@]}"
