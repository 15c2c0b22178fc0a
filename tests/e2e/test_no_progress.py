"""`--no-progress` silences every progress bar: `simulate` and `demo` (the grid's is tested with the grid). The
demo then says, in plain lines, what the PS waits for and each round that closed: nothing waits in silence."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BAR = ("it/s", "round/s", "s/round", "%|")


def fedmqtt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedmqtt", *args], capture_output=True, text=True, timeout=240)


def test_simulate_draws_a_bar_unless_told_not_to(tmp_path: Path) -> None:
    # Execute
    with_bar = fedmqtt("simulate", "--rounds", "1", "--out", str(tmp_path / "a"))
    without = fedmqtt("simulate", "--rounds", "1", "--out", str(tmp_path / "b"), "--no-progress")
    # Assert: the flag is what removes it (same run otherwise)
    assert with_bar.returncode == without.returncode == 0, without.stderr
    assert any(mark in with_bar.stderr for mark in BAR)
    assert not any(mark in without.stderr + without.stdout for mark in BAR), without.stderr


def test_demo_without_a_bar_prints_each_round_and_what_it_waits_for() -> None:
    # Execute
    done = fedmqtt("demo", "--rounds", "2", "--no-progress")
    # Assert
    assert done.returncode == 0, done.stderr[-2000:]
    assert not any(mark in done.stderr + done.stdout for mark in BAR), done.stderr
    assert "round 1/2: mean val auroc" in done.stdout and "round 2/2: mean val auroc" in done.stdout
    assert "waiting for" in done.stdout
