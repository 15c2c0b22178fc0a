"""Experiment tracking (`--track`): what TensorBoard and MLflow hold after a run equals the run's report.

The TensorBoard and MLflow tests run a short simulation of the bundled heart-disease sites through the CLI
and read the tracker's own files back with the tracker's own reader (TensorBoard's EventAccumulator,
MLflow's client on the file store). Each skips, saying which package, where its package is not installed;
the rest (option parsing, the missing-package error, a failing tracker) needs neither.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fedmqtt.cli import app
from fedmqtt.errors import ConfigError
from fedmqtt.simulation import SimulationConfig, run_simulation
from fedmqtt.tracking import RunTracker, parse_track, parse_tracks
from fedmqtt.tracking.scalars import round_scalars
from schemas.messages import ModelSpec, RoundMetrics, TrainSettings

ROUNDS = 3
SIM_ARGS = ["simulate", "--rounds", str(ROUNDS), "--epochs", "1", "--no-progress"]
GRID_AXES = 'algorithms = ["fedavg", "fedprox"]\nnorms = ["none"]\n'
GRID_BASE = ('[base]\nrounds = 2\n[base.model]\nname = "mlp"\n'
             'args = { in_features = 15, hidden = [8], norm = "none" }\n')


def _needs(module: str, extra: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed (pip install 'fedmqtt[{extra}]')")


def _simulate(tmp_path: Path, *track: str) -> tuple[Path, dict[str, Any]]:
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [*SIM_ARGS, "--out", str(out), *(a for t in track for a in ("--track", t))])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return out, json.loads((out / "report.json").read_text())


def _expected_rounds(report: dict[str, Any]) -> dict[str, dict[int, float]]:
    """tag -> step -> value, read from report.json independently of fedmqtt.tracking."""
    tags: dict[str, dict[int, float]] = {}
    for r in report["rounds"]:
        values = {f"val/{k}": v for k, v in r["mean"].items()}
        values |= {f"val_site/{k}/{site}": v for site, ms in r["per_site"].items() for k, v in ms.items()}
        values |= {"train/loss": r["train_loss"], "round/duration_s": r["duration_s"],
                   "round/sites": len(r["sites"])}
        for tag, value in values.items():
            if value is not None:
                tags.setdefault(tag, {})[r["round"]] = value
    return tags


def _expected_final(report: dict[str, Any]) -> dict[str, float]:
    final = {f"test/{k}": v for k, v in report["final"]["mean"]["test"].items()}
    final |= {f"test_site/{k}/{site}": v for site, e in report["final"]["per_site"].items()
              for k, v in e["metrics"]["test"].items()}
    final |= {f"best_test/{k}": v for k, v in report["best"]["mean"]["test"].items()}
    final["best/round"] = report["best_round"]["round"]
    return {tag: value for tag, value in final.items() if value is not None}


# -- options and start-up -------------------------------------------------------------------------------------
def test_track_values_name_a_backend_and_resolve_local_places(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """DIR and file stores become absolute (a grid's worker reads the same spec); URIs stay as given."""
    # Prepare
    monkeypatch.chdir(tmp_path)
    # Execute
    specs = {v: parse_track(v) for v in ("tensorboard", "tensorboard:tb", "mlflow", "mlflow:ml",
                                         "mlflow:file:ml2", "mlflow:http://tracker:5000", "mlflow:sqlite:///m.db")}
    # Assert
    assert specs["tensorboard"].where is None and specs["mlflow"].where is None
    assert specs["tensorboard:tb"].where == str(tmp_path.resolve() / "tb")
    assert specs["mlflow:ml"].where == (tmp_path.resolve() / "ml").as_uri()
    assert specs["mlflow:file:ml2"].where == (tmp_path.resolve() / "ml2").as_uri()
    assert specs["mlflow:http://tracker:5000"].where == "http://tracker:5000"
    assert specs["mlflow:sqlite:///m.db"].where == "sqlite:///m.db"
    for bad, message in (("wandb", "unknown tracker 'wandb'"), ("mlflow:", "nothing after ':'")):
        with pytest.raises(ConfigError, match=message):
            parse_track(bad)
    with pytest.raises(ConfigError, match="one of each tracker"):
        parse_tracks(["tensorboard:a", "tensorboard:b"])


@pytest.mark.parametrize(("backend", "extra"), [("tensorboard", "track-tensorboard"), ("mlflow", "track-mlflow")])
@pytest.mark.parametrize("command", [["simulate", "--rounds", "1", "--out", "out"],
                                     ["grid", "grid.toml", "--out", "out"], ["ps", "start", "--config", "ps.toml"]])
def test_a_missing_package_stops_the_command_before_anything_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, extra: str, command: list[str]) -> None:
    """The error names the pip command, and comes before the run reads a file or writes its output folder."""
    # Prepare: the package cannot be imported, whether it is installed or not
    for name in [n for n in sys.modules if n == backend or n.startswith(backend + ".")] or [backend]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.chdir(tmp_path)
    # Execute
    result = CliRunner().invoke(app, [*command, "--track", backend])
    # Assert
    said = result.output + str(result.exception)  # grid prints its errors; the others raise them to main()
    assert result.exit_code != 0 and f"pip install 'fedmqtt[{extra}]'" in said, said
    assert isinstance(result.exception, ConfigError) or "error: --track" in result.output
    assert list(tmp_path.iterdir()) == []  # nothing written: no out folder, no partition, no report


def test_round_scalars_keep_sites_apart_from_means_and_leave_undefined_metrics_out() -> None:
    """A site may be called "mean"; an undefined metric (None) is missing, not 0."""
    # Prepare
    metrics = RoundMetrics(run_id="r", sender="ps", round=2, sites=("mean", "b"), per_site={
        "mean": {"auroc": 0.9, "loss": 0.3}, "b": {"auroc": None, "loss": 0.5}}, mean={"auroc": 0.9, "loss": 0.4},
        train_loss=None, duration_s=1.5, update_bytes={"mean": 10, "b": 32})
    # Execute
    scalars = round_scalars(metrics)
    # Assert
    assert scalars == {"val/auroc": 0.9, "val/loss": 0.4, "val_site/auroc/mean": 0.9, "val_site/loss/mean": 0.3,
                       "val_site/loss/b": 0.5, "round/duration_s": 1.5, "round/sites": 2.0,
                       "round/update_bytes": 42.0}


class BrokenTracker:
    """A backend whose every call fails, as a tracking server that went away would."""

    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def _fail(self, *args: object) -> None:
        self.calls += 1
        raise OSError("tracking server unreachable")

    log_config = log_scalars = log_final = logged_rounds = close = _fail


def test_a_failing_tracker_is_logged_and_never_stops_the_run(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Every call fails: the simulation still ends with its report and models; one warning says what failed."""
    # Prepare
    broken = BrokenTracker()
    tracker = RunTracker([broken])
    cfg = SimulationConfig(rounds=2, out_dir=tmp_path, model=ModelSpec(name="mlp", args={"in_features": 15,
                                                                                         "hidden": [8]}),
                           train=TrainSettings(epochs=1, batch_size=32, lr=0.01))
    # Execute
    with caplog.at_level(logging.DEBUG, logger="fedmqtt.tracking"):
        tracker.log_config(cfg.model_dump(mode="json"))
        report = run_simulation(cfg, progress=False, tracker=tracker)
        tracker.close()
    # Assert
    assert len(report["rounds"]) == 2 and (tmp_path / "final_model.safetensors").is_file()
    assert broken.calls == 1 + 2 + 1 + 1  # config, each round, the final report, close
    assert tracker.failures == {"broken": 5}
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "fedmqtt.tracking" and r.levelno == logging.WARNING]
    assert warnings[0] == ("tracking (broken): could not log the config: OSError: tracking server unreachable; "
                           "the run goes on")
    assert warnings[1:] == ["tracking (broken): 5 call(s) failed, the first said above (the others at debug level)"]


# -- TensorBoard ----------------------------------------------------------------------------------------------
def _event_accumulator(folder: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_tensorboard_scalars_per_round_equal_the_report(tmp_path: Path) -> None:
    """simulate --track tensorboard: each round's validation metrics, training loss and duration at step =
    round, the final and best-round test metrics at the last round, the config as text and hparams."""
    _needs("tensorboard", "track-tensorboard")
    # Execute
    out, report = _simulate(tmp_path, "tensorboard")
    events = _event_accumulator(out / "tensorboard" / "run")  # named by the output folder
    # Assert
    expected = _expected_rounds(report)
    assert "val/auroc" in expected and "val_site/auroc/cleveland" in expected and "train/loss" in expected
    for tag, per_round in expected.items():
        logged = {e.step: e.value for e in events.Scalars(tag)}
        assert logged.keys() == per_round.keys(), tag
        for step, value in per_round.items():  # TensorBoard keeps 32-bit floats
            assert math.isclose(logged[step], value, rel_tol=1e-6, abs_tol=1e-6), (tag, step)
    sizes = [e.value for e in events.Scalars("round/update_bytes")]
    assert len(sizes) == ROUNDS and all(size > 0 for size in sizes)
    for tag, value in _expected_final(report).items():
        (event,) = events.Scalars(tag)
        assert event.step == ROUNDS and math.isclose(event.value, value, rel_tol=1e-6, abs_tol=1e-6), tag
    (config,) = events.Tensors("config")
    assert '"algorithm": "fedavg"' in config.tensor_proto.string_val[0].decode()
    assert "_hparams_/session_start_info" in events.Tags()["tensors"]


def test_tensorboard_fresh_run_replaces_the_events_of_the_last(tmp_path: Path) -> None:
    """The same run name in the same folder again: one series per tag, not two drawn over each other."""
    _needs("tensorboard", "track-tensorboard")
    from fedmqtt.tracking import open_tracker

    # Execute
    for value in (1.0, 2.0):
        tracker = open_tracker(parse_tracks(["tensorboard"]), root=tmp_path, run_name="r", experiment="e",
                               config={"a": 1})
        tracker.round_closed(RoundMetrics(run_id="r", sender="ps", round=1, sites=("s",), per_site={},
                                          mean={"auroc": value}))
        tracker.close()
    # Assert
    assert [(e.step, e.value) for e in _event_accumulator(tmp_path / "tensorboard" / "r").Scalars("val/auroc")] \
        == [(1, 2.0)]


# -- MLflow ---------------------------------------------------------------------------------------------------
def _mlflow_client(store: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses file stores unless asked
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=store.resolve().as_uri())


def test_mlflow_history_per_round_equals_the_report_and_outputs_are_artifacts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """simulate --track mlflow: a finished run in experiment "fedmqtt" of the file store under the output
    folder; every metric's history by round equals report.json; params are the config; the models and the
    reports are artifacts."""
    _needs("mlflow", "track-mlflow")
    # Execute
    out, report = _simulate(tmp_path, "mlflow")
    client = _mlflow_client(out / "mlruns", monkeypatch)
    experiment = client.get_experiment_by_name("fedmqtt")
    (run,) = client.search_runs([experiment.experiment_id])
    # Assert
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["algorithm"] == "fedavg" and run.data.params["rounds"] == str(ROUNDS)
    assert run.data.params["train.epochs"] == "1"
    for tag, per_round in _expected_rounds(report).items():
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
        assert history == per_round, tag
    assert len(client.get_metric_history(run.info.run_id, "round/update_bytes")) == ROUNDS
    for tag, value in _expected_final(report).items():
        (metric,) = client.get_metric_history(run.info.run_id, tag)
        assert metric.step == ROUNDS and metric.value == value, tag
    artifacts = {f.path for folder in ("", "models", "reports")
                 for f in client.list_artifacts(run.info.run_id, folder or None)}
    assert {"config.json", "models/final_model.safetensors", "models/best_model.safetensors",
            "reports/report.json", "reports/report.md", "reports/per_site.csv"} <= artifacts
    local = Path(client.download_artifacts(run.info.run_id, "reports/report.json", str(tmp_path)))
    assert json.loads(local.read_text()) == report


def test_mlflow_resume_continues_the_unfinished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PS stopped and started again with --resume logs on into the same MLflow run; a fresh start does not."""
    _needs("mlflow", "track-mlflow")
    # Execute
    _start_twice(tmp_path)
    _start(tmp_path, live=[1], resume=False, report=None)  # a fresh start of the same run id: a new MLflow run
    client = _mlflow_client(tmp_path / "mlruns", monkeypatch)
    runs = client.search_runs([client.get_experiment_by_name("fedmqtt").experiment_id],
                              order_by=["attributes.start_time ASC"])
    # Assert
    assert [r.info.status for r in runs] == ["FINISHED", "KILLED"]
    history = client.get_metric_history(runs[0].info.run_id, "val/auroc")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3)]  # each round once
    assert client.get_metric_history(runs[0].info.run_id, "test/auroc")[0].value == 0.5


def test_tensorboard_resume_appends_and_fills_in_missed_rounds(tmp_path: Path) -> None:
    """The TensorBoard side of a resumed PS: the earlier start's events stay, missed rounds come from the
    report, and no round is there twice."""
    _needs("tensorboard", "track-tensorboard")
    # Execute
    _start_twice(tmp_path)
    # Assert
    events = _event_accumulator(tmp_path / "tensorboard" / "run-a")
    assert sorted((e.step, round(e.value, 6)) for e in events.Scalars("val/auroc")) == [(1, 0.1), (2, 0.2),
                                                                                        (3, 0.3)]


def _start_twice(root: Path) -> None:
    """A PS logs round 1 and is stopped; started again with --resume it logs round 3 live, and its report
    has rounds 1 to 3: round 2 closed while the first PS was going down, before it was logged."""
    _start(root, live=[1], resume=False, report=None)
    _start(root, live=[3], resume=True, report={
        "rounds": [{"round": r, "sites": ["s"], "per_site": {}, "mean": {"auroc": r / 10}, "train_loss": None,
                    "duration_s": 1.0} for r in (1, 2, 3)],
        "final": {"mean": {"test": {"auroc": 0.5}}}})


def _start(root: Path, *, live: list[int], resume: bool, report: dict[str, Any] | None) -> None:
    from fedmqtt.tracking import open_tracker

    specs = [parse_track(b) for b in ("tensorboard", "mlflow") if importlib.util.find_spec(b) is not None]
    tracker = open_tracker(specs, root=root, run_name="run-a", experiment="fedmqtt", config={"rounds": 3},
                           fresh=not resume, resume=resume)
    for r in live:
        tracker.round_closed(RoundMetrics(run_id="run-a", sender="ps", round=r, sites=("s",), per_site={},
                                          mean={"auroc": r / 10}))
    if report is not None:
        tracker.run_finished(report, root)
    tracker.close()


# -- grids ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("backend", "extra"), [("tensorboard", "track-tensorboard"), ("mlflow", "track-mlflow")])
def test_grid_tracks_one_run_per_point_grouped_by_the_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            backend: str, extra: str) -> None:
    """A TensorBoard folder per point under the grid's output; an MLflow experiment named by the grid file
    whose runs are named by the points and tagged with their axes."""
    _needs(backend, extra)
    # Prepare
    spec = tmp_path / "sweep.toml"
    spec.write_text(GRID_AXES + GRID_BASE)
    out = tmp_path / "out"
    points = ["fedavg-none-s0-natural", "fedprox-none-s0-natural"]
    # Execute
    result = CliRunner().invoke(app, ["grid", str(spec), "--out", str(out), "--no-progress", "--track", backend,
                                      "--engine", "serial"])
    # Assert
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    for point in points:
        report = json.loads((out / point / "report.json").read_text())
        auroc = [r["mean"]["auroc"] for r in report["rounds"]]
        if backend == "tensorboard":
            logged = [e.value for e in _event_accumulator(out / "tensorboard" / point).Scalars("val/auroc")]
            assert logged == pytest.approx(auroc, rel=1e-6)
        else:
            client = _mlflow_client(out / "mlruns", monkeypatch)
            experiment = client.get_experiment_by_name("sweep")
            (run,) = client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{point}'")
            assert run.data.tags["grid.algorithm"] == point.split("-")[0] and run.info.status == "FINISHED"
            history = client.get_metric_history(run.info.run_id, "val/auroc")
            assert [m.value for m in sorted(history, key=lambda m: m.step)] == auroc
            # the point's config and its final model, as for a single run
            assert run.data.params["algorithm"] == point.split("-")[0] and run.data.params["rounds"] == "2"
            models = {f.path for f in client.list_artifacts(run.info.run_id, "models")}
            assert "models/final_model.safetensors" in models
