"""`broker start` raises the open-file limit it passes to Mosquitto (two connections per site: 500 sites
need more than the common soft limit of 1,024), as far as the hard limit allows, without privilege."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

SCRIPT = """
import resource
from broker.process import raise_open_file_limit
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
print(raise_open_file_limit({wanted}), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def run(wanted: int) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(wanted=wanted)], capture_output=True, text=True,
                         check=True)
    returned, now = out.stdout.split()
    return int(returned), int(now)


def test_a_low_soft_limit_is_raised_to_what_was_asked() -> None:
    # Prepare
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-file limit here is {hard}: nothing to raise to")
    # Execute
    returned, now = run(4096)
    # Assert: the process (and so the broker it starts next) may open 4,096 files
    assert returned == now == 4096


def test_never_above_the_hard_limit() -> None:
    # Prepare
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard open-file limit here")
    # Execute
    returned, now = run(hard * 4)
    # Assert
    assert returned == now == hard
