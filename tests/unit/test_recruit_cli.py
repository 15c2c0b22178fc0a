"""`fedmqtt recruit` offline: the worked example from a partition manifest, with its plot."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from fedmqtt.cli import app

HIST = {"a": [30, 30, 20, 10, 5, 5, 0, 0, 0, 0], "b": [40, 40, 30, 20, 20, 10, 10, 10, 10, 10],
        "c": [0, 0, 0, 0, 0, 0, 0, 0, 5, 20], "d": [16, 16, 16, 16, 0, 0, 0, 0, 0, 0]}
SIZES = {"a": 100, "b": 200, "c": 25, "d": 64}


def test_recruit_preview_from_a_manifest(tmp_path: Path) -> None:
    """The ranking table, the recruited count for gamma_th 0.3 and a PNG, from a manifest file."""
    # Prepare
    manifest = tmp_path / "partition.json"
    manifest.write_text(json.dumps({"sites": [
        {"site": s, "n": SIZES[s], "histogram": {str(k): v for k, v in enumerate(h)}} for s, h in HIST.items()]}))
    png = tmp_path / "recruit.png"
    # Execute
    result = CliRunner().invoke(app, ["recruit", "--manifest", str(manifest), "--gamma-th", "0.3", "--png", str(png)])
    # Assert
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split()[1] for line in lines[1:5]] == ["b", "a", "d", "c"]
    assert "recruited 3 of 4" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recruit_needs_a_source() -> None:
    """Without a manifest or live credentials the command says what it needs."""
    result = CliRunner().invoke(app, ["recruit"])
    assert result.exit_code != 0 and "--manifest" in result.output
