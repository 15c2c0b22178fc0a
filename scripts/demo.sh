#!/usr/bin/env bash
# The main job: set up (if needed), then run a real federation on the bundled heart-disease data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fedmqtt demo "$@"
