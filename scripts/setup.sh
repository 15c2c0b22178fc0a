#!/usr/bin/env bash
# Install what fedmqtt needs, idempotently: Mosquitto (Debian packages), a virtualenv in .venv with
# torch and the package (editable, with the site and dev extras). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

have_mosquitto() {
  { command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ]; } \
    && command -v mosquitto_passwd >/dev/null && command -v mosquitto_sub >/dev/null
}
if ! have_mosquitto; then
  echo "[setup] installing mosquitto and mosquitto-clients (apt-get)"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto mosquitto-clients >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first and pinned: an unpinned torch may pull a multi-GB CUDA build. A GPU site installs its
# CUDA build of torch into .venv before running this script (see README); any torch>=2.2 is kept.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0"
  "${PIP[@]}" "torch==2.13.0"
fi
# Re-install whenever pyproject.toml changed (its hash, not its time stamp: a checkout sets times anew).
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if ! .venv/bin/python -c "import fedmqtt, paho.mqtt, pytest_timeout, wfdb, hypothesis, cryptography, opacus, Crypto" 2>/dev/null \
   || [ "$(cat .venv/.fedmqtt-installed 2>/dev/null)" != "$WANT" ]; then
  echo "[setup] installing fedmqtt (editable) with its site, ecg, privacy and dev extras"
  "${PIP[@]}" -e ".[site,ecg,privacy,dev]"
  echo "$WANT" > .venv/.fedmqtt-installed
fi
# Bytecode for the project's own modules (a tenth of a second; up to date is skipped). pip compiles what it
# installs, but not an editable package's sources, and where PYTHONDONTWRITEBYTECODE is set (containers often
# set it) every PS, site and test process would compile them again: about 0.2 CPU s per process start.
.venv/bin/python -m compileall -q -j 0 fedmqtt site_agent ps_daemon schemas broker >/dev/null
