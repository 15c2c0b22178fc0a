"""`fedmqtt ps start --track`: a PS killed after round 1 and resumed leaves one complete tracked run."""

from __future__ import annotations

import importlib.util
import json
import math
import signal
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROUNDS = 3
RUN_ID = "e2e-track"


def test_killed_and_resumed_ps_leaves_every_round_once_in_each_tracker(cli_federation,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Broker, PS and four sites as processes; the PS is SIGKILLed right after round 1's checkpoint and
    started again with --resume. Each installed tracker then holds every round's mean validation AUROC once,
    equal to report.json's, and the final test AUROC; MLflow in one finished run with the final model."""
    backends = [b for b in ("tensorboard", "mlflow") if importlib.util.find_spec(b) is not None]
    if not backends:
        pytest.skip("neither tensorboard nor mlflow is installed (pip install 'fedmqtt[track-tensorboard]' "
                    "'fedmqtt[track-mlflow]')")
    # Prepare
    fed = cli_federation("t", run_id=RUN_ID, rounds=ROUNDS)
    track = tuple(arg for b in backends for arg in ("--track", b))
    fed.start_broker()
    for site in fed.site_configs:
        fed.start_site(site)
    # Execute
    fed.start_ps(fault="after_checkpoint:1", extra=track)
    assert fed.procs["ps"].wait(180) == -signal.SIGKILL, fed.tail("ps")
    fed.start_ps(resume=True, extra=track)
    fed.wait_ps_done(240)
    # Assert
    out = fed.work / "ps"
    report = json.loads((out / "report.json").read_text())
    expected = {r["round"]: r["mean"]["auroc"] for r in report["rounds"]}
    final_auroc = report["final"]["mean"]["test"]["auroc"]
    assert sorted(expected) == list(range(1, ROUNDS + 1))
    if "tensorboard" in backends:
        _check_tensorboard(out / "tensorboard" / RUN_ID, expected, final_auroc)
    if "mlflow" in backends:
        _check_mlflow(out / "mlruns", expected, final_auroc, monkeypatch)


def _check_tensorboard(folder: Path, expected: dict[int, float], final_auroc: float) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("val/auroc")]
    assert sorted(step for step, _ in logged) == sorted(expected)  # each round once
    assert all(math.isclose(value, expected[step], rel_tol=1e-6) for step, value in logged)
    ((step, value),) = [(e.step, e.value) for e in events.Scalars("test/auroc")]
    assert step == ROUNDS and math.isclose(value, final_auroc, rel_tol=1e-6)
    configs = events.Tensors("config")  # the PS's config as text (again after the resume, if logged then too)
    assert configs and all(f'"run_id": "{RUN_ID}"' in c.tensor_proto.string_val[0].decode() for c in configs)


def _check_mlflow(store: Path, expected: dict[int, float], final_auroc: float,
                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("fedmqtt").experiment_id])
    assert run.info.run_name == RUN_ID and run.info.status == "FINISHED"
    assert run.data.params["run_id"] == RUN_ID and run.data.params["rounds"] == str(ROUNDS)  # the PS's config
    assert "credentials" not in run.data.params  # where its password is stays out of the tracker
    history = client.get_metric_history(run.info.run_id, "val/auroc")
    assert sorted((m.step, m.value) for m in history) == sorted(expected.items())
    assert [m.value for m in client.get_metric_history(run.info.run_id, "test/auroc")] == [final_auroc]
    models = {f.path for f in client.list_artifacts(run.info.run_id, "models")}
    assert "models/final_model.safetensors" in models
