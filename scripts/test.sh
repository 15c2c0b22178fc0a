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
# Every test has its own broker, port and folders, so tests run in parallel: three pytest-xdist workers per
# core, at most 8 (each may run a federation of six processes, about 1.5 GB). Three per core because an
# end-to-end test spends most of its time waiting (for a round, a deadline, a reconnect, a browser) while its
# processes sleep: on two cores, two workers kept about one core busy (1,556 tests in 607 s), six keep 1.8
# busy (1,904 tests in 299 s). loadgroup keeps a module whose tests share an expensive module-scoped fixture
# on one worker (tests/conftest.py names them). "$@" comes last, so `scripts/test.sh -n 0` runs everything
# in this process.
WORKERS="$(( $(nproc) * 3 ))"
if [ "$WORKERS" -gt 8 ]; then WORKERS=8; fi
set +e
.venv/bin/python -m pytest -n "$WORKERS" --dist loadgroup "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; fi
exit "$rc"
