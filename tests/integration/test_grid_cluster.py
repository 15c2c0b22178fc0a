"""`fedmqtt grid --engine dask`: the grid's runs on a real Dask LocalCluster of two worker processes.

The same grid run serially and on the cluster must end with the same bits (final and best-round
weights, every metric of report.json), write the same grid.json statuses, resume the same way, and
record a point that fails on a worker as failed, as the serial path does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from dask import distributed
from safetensors.numpy import load_file
from typer.testing import CliRunner

from fedmqtt.cli import app
from fedmqtt.errors import ConfigError
from fedmqtt.experiments.engines import DaskEngine, SerialEngine
from fedmqtt.experiments.grid import load_grid, run_grid

GRID = """algorithms = ["fedavg", { name = "fedprox", hyper = { mu = 0.1 } }]
norms = ["none"]
seeds = [3]
[base]
rounds = 3
[base.model]
name = "mlp"
args = { in_features = 15, hidden = [8], norm = "none" }
"""
RUNS = ["fedavg-none-s3-natural", "fedprox-none-s3-natural"]

@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """Two single-threaded worker processes, as `--engine dask --workers 2` starts them."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=logging.ERROR) as local:
        yield local

def weights(run_dir: Path, which: str) -> dict[str, np.ndarray]:
    return load_file(str(run_dir / f"{which}_model.safetensors"))

def comparable(run_dir: Path) -> dict:
    """report.json less what two runs of one config never share: clock times (timings, usage, when each round
    started and how long it took), traffic (message sizes vary with those times) and the run's own folder."""
    report = json.loads((run_dir / "report.json").read_text().replace(str(run_dir), "RUN"))
    rounds = [{k: v for k, v in r.items() if k not in ("started_at", "closed_at", "duration_s")}
              for r in report["rounds"]]
    return {**{k: v for k, v in report.items() if k not in ("timings", "usage", "traffic")}, "rounds": rounds}


def test_dask_grid_is_bit_identical_to_the_serial_grid_and_resumes_alike(tmp_path: Path, cluster) -> None:
    """2 points x 3 rounds on the bundled heart-disease sites: the same weights and metrics either way."""
    # Prepare
    (tmp_path / "grid.toml").write_text(GRID)
    grid = load_grid(tmp_path / "grid.toml")
    # Execute
    serial = run_grid(grid, tmp_path / "serial", progress=False, engine=SerialEngine())
    dask = run_grid(grid, tmp_path / "dask", progress=False, engine=DaskEngine(cluster.scheduler_address))
    again = run_grid(grid, tmp_path / "dask", progress=False, engine=DaskEngine(cluster.scheduler_address))
    # Assert
    assert [e["status"] for e in serial] == [e["status"] for e in dask] == ["done", "done"]
    assert [e["status"] for e in again] == ["cached", "cached"]
    for run in RUNS:
        a, b = tmp_path / "serial" / run, tmp_path / "dask" / run
        for which in ("final", "best"):
            wa, wb = weights(a, which), weights(b, which)
            assert sorted(wa) == sorted(wb)
            assert all(np.array_equal(wa[k], wb[k]) and wa[k].dtype == wb[k].dtype for k in wa), (run, which)
        ra, rb = comparable(a), comparable(b)
        assert len(ra["rounds"]) == 3 and ra["final"]["mean"]
        assert ra == rb
    docs = [json.loads((tmp_path / d / "grid.json").read_text()) for d in ("serial", "dask")]
    assert [[p["run"] for p in d["points"]] for d in docs] == [RUNS, RUNS]
    assert [p["status"] for p in docs[1]["points"]] == ["cached", "cached"]
    assert all(p["wall_s"] > 0 for p in docs[1]["points"])

def test_a_point_failing_on_a_worker_is_failed_in_grid_json(tmp_path: Path, cluster) -> None:
    """Through the CLI: one point cannot start (its pretrained file is missing), the other runs; exit 1."""
    # Prepare
    missing = tmp_path / "missing.safetensors"
    (tmp_path / "grid.toml").write_text(GRID.replace(
        '{ name = "fedprox", hyper = { mu = 0.1 } }',
        f'{{ name = "fedavg", label = "broken", config = {{ pretrained = "{missing}" }} }}').replace(
        "rounds = 3", "rounds = 1"))
    out = tmp_path / "out"
    # Execute
    result = CliRunner().invoke(app, ["grid", str(tmp_path / "grid.toml"), "--out", str(out), "--engine", "dask",
                                      "--cluster", cluster.scheduler_address, "--no-progress"])
    # Assert
    assert result.exit_code == 1, result.output
    points = {p["run"]: p for p in json.loads((out / "grid.json").read_text())["points"]}
    assert points["fedavg-none-s3-natural"]["status"] == "done"
    broken = points["broken-none-s3-natural"]
    assert broken["status"] == "failed" and str(missing) in broken["error"]
    assert broken["error"].startswith("InitModelError") and "No such file" in broken["error"]  # checked, not crashed
    assert not (out / "broken-none-s3-natural" / "report.json").exists()

def test_what_the_engine_itself_cannot_run_comes_back_as_that_jobs_outcome(cluster) -> None:
    """An exception raised on a worker outside the job's own handling is yielded, not raised."""
    # Prepare
    engine = DaskEngine(cluster.scheduler_address)
    # Execute
    outcomes = dict(engine.run(json.loads, [("good", {"s": '{"status": "done"}'}), ("bad", {"s": "{"})]))
    # Assert
    assert outcomes["good"] == {"status": "done"}
    assert isinstance(outcomes["bad"], json.JSONDecodeError)

def test_local_cluster_engine_starts_and_stops_its_own_workers() -> None:
    """`--engine dask --workers 2` without --cluster: a LocalCluster for the run, closed after it."""
    # Prepare
    engine = DaskEngine(workers=2)
    # Execute
    outcomes = dict(engine.run(json.loads, [(str(k), {"s": str(k)}) for k in range(3)]))
    # Assert
    assert outcomes == {"0": 0, "1": 1, "2": 2}


def test_workers_with_several_threads_are_refused() -> None:
    """Two points in one process would share torch's global generator: such a cluster is refused, by name."""
    # Prepare
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0",
                                  silence_logs=logging.ERROR) as threaded:
        engine = DaskEngine(threaded.scheduler_address)
        # Execute / Assert
        with pytest.raises(ConfigError, match="more than one thread.*--nthreads 1"):
            list(engine.run(json.loads, [("a", {"s": "1"})]))


def test_grid_uses_two_workers_by_default_with_the_serial_bits(tmp_path: Path, capfd: pytest.CaptureFixture[str]
                                                              ) -> None:
    """`fedmqtt grid` without --engine: two points go to a local cluster of two workers (the `auto` engine) and
    end with the bits of `--engine serial`."""
    # Prepare
    (tmp_path / "grid.toml").write_text(GRID)
    # Execute
    default = CliRunner().invoke(app, ["grid", str(tmp_path / "grid.toml"), "--out", str(tmp_path / "default")])
    bars = default.stderr + default.stdout + capfd.readouterr().err
    serial = CliRunner().invoke(app, ["grid", str(tmp_path / "grid.toml"), "--out", str(tmp_path / "serial"),
                                      "--engine", "serial", "--no-progress"])
    # Assert
    assert default.exit_code == 0 and serial.exit_code == 0, default.output + serial.output
    assert "grid (dask)" in bars and "grid (serial)" not in bars, bars
    for run in RUNS:
        a, b = tmp_path / "default" / run, tmp_path / "serial" / run
        for which in ("final", "best"):
            wa, wb = weights(a, which), weights(b, which)
            assert sorted(wa) == sorted(wb)
            assert all(np.array_equal(wa[k], wb[k]) and wa[k].dtype == wb[k].dtype for k in wa), (run, which)
        assert comparable(a) == comparable(b)
