"""The one partition job: `fedmqtt partition` and a grid's partition axis write the same manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedmqtt.cli.partition import app
from fedmqtt.data.partition_job import prepare_job
from fedmqtt.data.partitioners import PartitionSpec
from fedmqtt.data.spec import DataSpec
from fedmqtt.errors import DataError
from fedmqtt.experiments.grid import PartitionAxis, partition_sites

HEADER = ("id,gender,age,hypertension,heart_disease,ever_married,work_type,Residence_type,avg_glucose_level,"
          "bmi,smoking_status,stroke")


def stroke_csv(tmp_path: Path, n: int = 60) -> Path:
    rows = [f"{k},{'Male' if k % 2 else 'Female'},{20 + k},0,0,Yes,Private,{'Urban' if k % 3 else 'Rural'},"
            f"{100 + (k * 7) % 50},{20 + k % 11},never smoked,{int(k % 4 == 0)}" for k in range(n)]
    path = tmp_path / "stroke.csv"
    path.write_text(HEADER + "\n" + "\n".join(rows) + "\n")
    return path


def test_cli_and_grid_write_the_same_manifest(tmp_path: Path) -> None:
    """Spec seed 2 + run seed 1 in a grid is seed 3 on the command line: the same file, byte for byte."""
    # Prepare
    csv = stroke_csv(tmp_path)
    pooled = DataSpec(format="table", path=csv, options={"spec": "stroke"})
    axis = PartitionAxis(name="feat", data=pooled,
                         spec=PartitionSpec(kind="feature_samples", n_sites=3, column="auto_min", seed=2))
    # Execute
    sites = partition_sites(axis, 1, tmp_path / "grid")
    result = CliRunner().invoke(app, ["-f", "table", "--path", str(csv), "-o", "spec=stroke", "--kind",
                                      "feature_samples", "--column", "auto_min", "-k", "3", "--seed", "3",
                                      "--out", str(tmp_path / "cli")])
    # Assert
    assert result.exit_code == 0, result.output
    from_grid = tmp_path / "grid" / "partitions" / "feat-s1" / "partition.json"
    assert from_grid.read_text() == (tmp_path / "cli" / "partition.json").read_text()
    manifest = json.loads(from_grid.read_text())
    assert manifest["source"]["column_rule"] == "auto_min" and manifest["spec"]["column"] != "auto_min"
    assert f"feature: {manifest['spec']['column']} (auto_min: smallest |Pearson r|)" in result.output
    assert sorted(sites) == ["site-0", "site-1", "site-2"]
    assert (from_grid.parent / "partition.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prepare_settles_the_column_before_anything_is_written(tmp_path: Path) -> None:
    """natural: the site column's values; a missing column names the dataset and the columns it has."""
    # Prepare
    pooled = DataSpec(format="table", path=stroke_csv(tmp_path), options={"spec": "stroke"})
    # Execute
    job = prepare_job(pooled, PartitionSpec(kind="natural", column="Residence_type"))
    # Assert
    assert job.groups is not None and len(job.groups) == 60 and job.rule is None
    with pytest.raises(DataError, match=r"no site column 'ward' in .*stroke\.csv; columns: .*Residence_type"):
        prepare_job(pooled, PartitionSpec(kind="natural", column="ward"), dataset=str(pooled.path))
    assert list(tmp_path.iterdir()) == [tmp_path / "stroke.csv"]
