#!/usr/bin/env bash
# The test suite: set up (if needed), then pytest (unit, integration against a real Mosquitto, e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; fi
exit "$rc"
