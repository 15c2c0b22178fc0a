"""A site goes online before torch has loaded: the agent module does not import torch, and the trainer is
built on a worker thread (issue 16, start-up)."""

from __future__ import annotations

import subprocess
import sys


def test_the_agent_module_does_not_import_torch() -> None:
    # Execute: a fresh interpreter, as `fedmqtt site start` is
    out = subprocess.run([sys.executable, "-c", "import sys, site_agent.agent, fedmqtt.cli; "
                          "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"],
                         capture_output=True, text=True, check=True)
    # Assert
    assert out.stdout.strip() == "[]"
