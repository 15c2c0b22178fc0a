#!/usr/bin/env bash
# The test suite: set up (if needed), then pytest (unit, integration against a real Mosquitto, e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Headless Chromium and its driver for the dashboard's real-browser tests (Debian's packages; tests only).
if ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }; then
  SUDO=""; if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "[test] installing chromium and chromium-driver (apt-get) for the browser tests"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; fi
exit "$rc"
