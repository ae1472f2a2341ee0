#!/bin/sh
# Thin entry point for dynamo_side_by_side.py: Dynamo's mocker + KV router vs.
# router-host replay on the same trace. All arguments are passed through; see --help.
set -eu
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
PYTHON=${PYTHON:-python3}
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: $PYTHON not found (Python 3.10 or newer is needed; set PYTHON=...)" >&2
    exit 1
fi
exec nice -n "${NICE:-10}" "$PYTHON" "$here/dynamo_side_by_side.py" "$@"
