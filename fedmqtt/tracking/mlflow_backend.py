"""MLflow: one MLflow run per fedmqtt run, through `MlflowClient` (no global "active run", so a grid's runs
or a PS beside other code never share state).

Params are the flattened config (and config.json as an artifact, whole), metrics are logged with
step = round, and at the end the final metrics and the models and reports become the run's artifacts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedmqtt.tracking.scalars import ROUND_MARK, ParamValue
from fedmqtt.tracking.spec import is_local_store

# log_batch takes at most 100 params and 1000 metrics a call (MLflow's REST limits, the file store too)
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
RUN_TAG = "fedmqtt.run"  # the fedmqtt run's name: a resumed PS finds its MLflow run by it


class MlflowBackend:
    """A run named `run_name` in `experiment` of the tracking store `uri`. `resume`: continue the newest
    unfinished run of that name (a PS started again with --resume) instead of starting a new one."""

    name = "mlflow"

    def __init__(self, uri: str, *, experiment: str, run_name: str, tags: Mapping[str, str],
                 resume: bool = False) -> None:
        if is_local_store(uri):
            # MLflow 3 keeps file stores in maintenance mode and refuses them unless asked; a local file
            # store is what this default is, so ask for it (an explicit setting of the variable wins).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        experiment_id = self._experiment_id(experiment)
        run = self._unfinished_run(experiment_id, run_name) if resume else None
        if run is None:
            run = self.client.create_run(experiment_id, run_name=run_name, tags={RUN_TAG: run_name, **tags})
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id: str = run.info.run_id

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except MlflowException:  # a grid point on another worker created it first
            again = self.client.get_experiment_by_name(name)
            if again is None:
                raise
            return str(again.experiment_id)

    def _unfinished_run(self, experiment_id: str, run_name: str) -> Any:
        runs = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_name}'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
        return runs[0] if runs and runs[0].info.status != "FINISHED" else None

    def log_config(self, params: Mapping[str, ParamValue], config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params  # a resumed run has them (MLflow refuses changes)
        items = [Param(k, str(v)) for k, v in sorted(params.items()) if k not in existing]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + PARAMS_PER_BATCH])
        self.client.log_dict(self.run_id, dict(config), "config.json")

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in sorted(scalars.items())]
        for i in range(0, len(items), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + METRICS_PER_BATCH])

    def log_final(self, step: int, scalars: Mapping[str, float], files: Sequence[Path]) -> None:
        self.log_scalars(step, scalars)
        for path in files:
            folder = "models" if path.suffix == ".safetensors" else "reports"
            self.client.log_artifact(self.run_id, str(path), folder)

    def logged_rounds(self) -> set[int]:
        return {m.step for m in self.client.get_metric_history(self.run_id, ROUND_MARK)}

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)
