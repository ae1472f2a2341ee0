#!/usr/bin/env bash
# The chaos test: mock engines behind `router-host serve` under steady load while engines are
# killed and restarted, KV-event connections cut, Redis restarted and the config reloaded, at
# random (seeded), on 127.0.0.1. README.md beside this file says what is checked.
#
#   router-host/scripts/chaos/run.sh [--duration S] [--seed N] [--out DIR] [--config-overlay FILE]
#                                    [--expect-no-stream-failures] [--over-capacity] [-- DRIVER-FLAGS...]
#
#   --duration S                 seconds of load (default 600)
#   --seed N                     seeds the load and the chaos (default 1)
#   --out DIR                    chaos.json, chaos.md, router.yaml and logs/ (default:
#                                TARGET/chaos/run)
#   --config-overlay FILE        YAML merged key by key into the generated serve config
#                                (e.g. `serve: {migration_limit: 1}`)
#   --expect-no-stream-failures  also fail when any streamed request failed, even with a clear
#                                error (for when mid-stream migration is on)
#   --over-capacity              drive the router over capacity (over-capacity.yaml: priority
#                                classes, a queue bound of 8, saturated engines) and check that
#                                it sheds, each refusal with its reason
#   -- DRIVER-FLAGS              passed to chaos.py as they are (`python3 chaos.py --help`)
#
# Exit 0 when every check passed, 1 when one failed (the report says which), 2 on bad usage.
#
# Environment:
#   CARGO_TARGET_DIR     honoured (default: the repository's target/)
#   ROUTER_CHAOS_CACHE   where a venv with PyYAML goes if python3 has none (default
#                        ~/.cache/router-host-chaos)
set -euo pipefail
export PYTHONDONTWRITEBYTECODE=1

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
CACHE="${ROUTER_CHAOS_CACHE:-$HOME/.cache/router-host-chaos}"
PYYAML_VERSION=6.0.2

log() { printf '[chaos %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
usage() { log "$*"; sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

DURATION=600
SEED=1
OUT=""
OVERLAY=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) [ $# -ge 2 ] || usage "--duration needs seconds"; DURATION="$2"; shift ;;
    --seed) [ $# -ge 2 ] || usage "--seed needs a number"; SEED="$2"; shift ;;
    --out) [ $# -ge 2 ] || usage "--out needs a directory"; OUT="$2"; shift ;;
    --config-overlay) [ $# -ge 2 ] || usage "--config-overlay needs a file"; OVERLAY="$2"; shift ;;
    --expect-no-stream-failures) EXTRA+=(--expect-no-stream-failures) ;;
    --over-capacity) EXTRA+=(--over-capacity) ;;
    --) shift; EXTRA+=("$@"); break ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) usage "unknown argument \`$1\`" ;;
  esac
  shift
done
[[ "$DURATION" =~ ^[0-9]+$ ]] || usage "--duration: a whole number of seconds, got \`$DURATION\`"
[[ "$SEED" =~ ^[0-9]+$ ]] || usage "--seed: a whole number, got \`$SEED\`"
if [ -n "$OVERLAY" ]; then
  [ -f "$OVERLAY" ] || usage "--config-overlay: no file \`$OVERLAY\`"
  OVERLAY="$(cd "$(dirname "$OVERLAY")" && pwd)/$(basename "$OVERLAY")"
  EXTRA+=(--config-overlay "$OVERLAY")
fi

TARGET="${CARGO_TARGET_DIR:-$REPO/target}"
case "$TARGET" in /*) ;; *) TARGET="$REPO/$TARGET" ;; esac
[ -n "$OUT" ] || OUT="$TARGET/chaos/run"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# The session store is a real redis-server (Debian package), installed as .ci/run does; the
# driver is standard library Python but for PyYAML (the config and --config-overlay).
. "$HERE/../lib/setup.sh"
debian_packages redis-server
python_with_yaml "$CACHE" "$PYYAML_VERSION"

# The classifier first: a lost request must be seen as lost (a stand-in server, a second).
"$PYTHON" "$HERE/chaos.py" --self-test || die "the driver's self-test failed: its classifier is wrong"

log "cargo build --release -p router-host -p two-tier-cost-fn"
t0=$SECONDS
(cd "$REPO" && cargo build --release -p router-host -p two-tier-cost-fn) || die "cargo build --release failed"
BIN="$TARGET/release/router-host"
PLUGIN="$TARGET/release/libtwo_tier_cost_fn.so"
[ -x "$BIN" ] || die "no $BIN after the build"
[ -f "$PLUGIN" ] || die "no $PLUGIN after the build"
log "build took $((SECONDS - t0)) s"

COMMAND="router-host/scripts/chaos/run.sh --duration $DURATION --seed $SEED"
[ -z "$OVERLAY" ] || COMMAND+=" --config-overlay $(basename "$OVERLAY")"
for x in "${EXTRA[@]}"; do case "$x" in --expect-no-stream-failures|--over-capacity) COMMAND+=" $x" ;; esac; done

# exec: a signal to this script reaches the driver, which stops every process it started.
exec "$PYTHON" "$HERE/chaos.py" --router-host "$BIN" --plugin "$PLUGIN" --duration "$DURATION" \
  --seed "$SEED" --out "$OUT" --command "$COMMAND" "${EXTRA[@]}"
