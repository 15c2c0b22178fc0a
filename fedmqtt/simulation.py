"""`fedmqtt simulate`: the PS runner and every site agent in one process, over an in-memory broker.

Same code path as a deployment (state machine, strategies, site training, codec), only the
transport differs, so a simulated run and an MQTT run with the same config and seed end with
bit-identical weights on CPU (tested).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm import tqdm

from fedmqtt.config_io import load_toml, validate_config
from fedmqtt.data.heart_disease import SITES, bundled_path
from fedmqtt.transport.memory import MemoryBroker, MemoryTransport
from fedmqtt.errors import ConfigError
from fedmqtt.strategies.params import LOCAL_OPTIMISER_KEYS, check_local_optimiser
from fedmqtt.training.client_rules import SGD_ONLY, optimiser_problem
from ps_daemon.config import NEEDS_PRETRAINED, DaemonConfig
from schemas.base import ID_PATTERN
from schemas.messages import ModelSpec, TrainSettings
from fedmqtt.data.spec import DataSpec
from site_agent.config import SiteConfig

IN_PROCESS = Path("(in-process)")
DEFAULT_MODEL = ModelSpec(name="mlp", args={"in_features": 15, "hidden": [32, 32], "norm": "none", "dropout": 0.3})
DEFAULT_TRAIN = TrainSettings(epochs=2, batch_size=32, lr=0.001, optimizer="adam")
# For the algorithms whose client rule is defined for plain SGD only (SCAFFOLD option II, FedNova's
# ||a_i||_1): what a run gets when its train settings were left at DEFAULT_TRAIN. lr 0.05: plain SGD
# needs a larger step than Adam's 0.001 to move the bundled MLP within a few rounds.
SGD_TRAIN = TrainSettings(epochs=2, batch_size=32, lr=0.05, optimizer="sgd")
# AdaFed / d-AdaFed need a pretrained model; a simulation makes one from this share of the pooled
# training rows when none is given (as seed 001 does).
DEFAULT_PRETRAIN_FRACTION = 0.2


def bundled_sites() -> dict[str, DataSpec]:
    """The four UCI heart-disease hospitals shipped with the package (natural split)."""
    return {site: DataSpec(format="heart_disease", path=bundled_path(site)) for site in SITES}


class SimulationConfig(BaseModel):
    """A federation described in one file: the PS settings plus each site's data."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(default="sim", pattern=ID_PATTERN)
    algorithm: str = "fedavg"
    hyper: dict[str, float] = Field(default_factory=dict)
    rounds: int = Field(default=20, ge=1)
    seed: int = 0
    selection_metric: str = "auroc"
    out_dir: Path = Path("runs/sim")
    model: ModelSpec = DEFAULT_MODEL
    train: TrainSettings = DEFAULT_TRAIN
    sites: dict[str, DataSpec] = Field(default_factory=bundled_sites)
    # In a simulation the researcher holds every site's data, so histograms may "leave" (FedDkw needs them).
    share_label_histograms: bool = True
    selection: str = "all"  # all | fraction | recruited (validated by the PS config)
    fraction: float | None = None
    recruitment: dict[str, float] = Field(default_factory=dict)  # gamma_dv, gamma_sa, gamma_th
    pretrained: Path | None = None  # AdaFed / d-AdaFed: a model trained outside the federation
    # Simulation only, as seed 001 does: pretrain that model on this fraction of the pooled training rows.
    pretrain_fraction: float | None = Field(default=None, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        """Defaults that depend on the algorithm (see `algorithm_defaults`)."""
        return algorithm_defaults(data) if isinstance(data, dict) else data

    def daemon_config(self) -> DaemonConfig:
        stray = sorted(set(self.train.hyper) - set(LOCAL_OPTIMISER_KEYS))
        if stray:  # the algorithm's own keys belong in `hyper`, where its parameter check sees them
            raise ConfigError(f"simulation config: train.hyper may hold only {', '.join(LOCAL_OPTIMISER_KEYS)}; "
                              f"move {', '.join(stray)} to `hyper`")
        local = {**self.train.hyper, **self.hyper}  # as the PS merges them into each task
        try:
            check_local_optimiser(local, self.train.optimizer)
        except ConfigError as exc:
            raise ConfigError(f"simulation config: {exc}") from None
        if self.algorithm == "scaffold" and (problem := optimiser_problem(self.algorithm, "sgd", local)):
            raise ConfigError(f"simulation config: {problem}")
        if self.algorithm == "central":  # the pooled baseline has no PS; validate as FedAvg would
            return self.model_copy(update={"algorithm": "fedavg", "hyper": {}}).daemon_config()
        return validate_config({
            "run_id": self.run_id, "algorithm": self.algorithm, "rounds": self.rounds, "seed": self.seed,
            "sites": sorted(self.sites), "out_dir": self.out_dir, "model": self.model, "train": self.train,
            "credentials": IN_PROCESS, **({"hyper": self.hyper} if self.hyper else {}),
            "selection": self.selection, "fraction": self.fraction, "recruitment": self.recruitment,
            "selection_metric": self.selection_metric,
            # pretrain_fraction: the model is pretrained when the run starts (placeholder for validation)
            "pretrained": self.pretrained or (Path("(pretrained at start)") if self.pretrain_fraction else None),
        }, DaemonConfig, source="simulation config")

    def site_configs(self) -> list[SiteConfig]:
        return [SiteConfig(site_id=site, run_id=self.run_id, credentials=IN_PROCESS,
                           state_dir=self.out_dir / "state" / site, data=spec, device="cpu", threads=1,
                           share_label_histogram=self.share_label_histograms)
                for site, spec in sorted(self.sites.items())]


def algorithm_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (a SimulationConfig as a dict) with the defaults its algorithm needs to run at all.

    - SCAFFOLD and FedNova need plain SGD: train settings left at DEFAULT_TRAIN (or not given) become
      SGD_TRAIN. Train settings the user changed are kept, so a user's Adam is an error that names the
      fix (train.optimizer = "sgd"), never silently replaced.
    - AdaFed's statistics are BatchNorm's: the default model (no norm layers) gets norm = "bn".
    - AdaFed and d-AdaFed need a pretrained model: without `pretrained` or `pretrain_fraction` the
      simulation pretrains on DEFAULT_PRETRAIN_FRACTION of the pooled training rows.
    """
    algorithm = data.get("algorithm")
    out = dict(data)
    if algorithm in SGD_ONLY:
        train = out.get("train")
        given = TrainSettings.model_validate(train) if train is not None else DEFAULT_TRAIN
        if given == DEFAULT_TRAIN:
            out["train"] = SGD_TRAIN
    if algorithm == "adafed":
        model = out.get("model")
        if model is None or ModelSpec.model_validate(model) == DEFAULT_MODEL:
            out["model"] = DEFAULT_MODEL.model_copy(update={"args": {**DEFAULT_MODEL.args, "norm": "bn"}})
    if algorithm in NEEDS_PRETRAINED and out.get("pretrained") is None and out.get("pretrain_fraction") is None:
        out["pretrain_fraction"] = DEFAULT_PRETRAIN_FRACTION
    return out


def load_simulation_config(path: Path | None, **overrides: Any) -> SimulationConfig:
    """The config file (relative paths resolved against its folder) with CLI overrides applied."""
    base = SimulationConfig() if path is None else load_toml(path, SimulationConfig)
    if path is not None:
        root = Path(path).resolve().parent
        sites = {s: d.resolved(root) for s, d in base.sites.items()}
        out = base.out_dir if base.out_dir.is_absolute() else root / base.out_dir
        base = base.model_copy(update={"sites": sites, "out_dir": out})
    updates = {k: v for k, v in overrides.items() if v is not None}
    return SimulationConfig.model_validate({**base.model_dump(), **updates})


def run_simulation(config: SimulationConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run the whole federation in this process; returns the report (also written to out_dir).

    `algorithm = "central"` is the pooled baseline instead (fedmqtt.central): no federation at all.
    """
    if config.algorithm == "central":
        from fedmqtt.central import run_central

        return finish_report(config, run_central(config, progress=progress))
    from ps_daemon.runner import DaemonRunner
    from site_agent.agent import SiteAgent
    import json

    if config.pretrain_fraction is not None and config.pretrained is None:
        config = config.model_copy(update={"pretrained": pretrain_pooled(config)})
    daemon_cfg = config.daemon_config()
    shutil.rmtree(config.out_dir / "state", ignore_errors=True)  # a fresh run: no stored uplinks
    broker = MemoryBroker()

    def factory(**kw: Any) -> MemoryTransport:
        return MemoryTransport(broker, **kw)

    agents = [SiteAgent(cfg, transport_factory=factory) for cfg in config.site_configs()]
    runner = DaemonRunner(daemon_cfg, force=True, transport_factory=factory)  # a simulation always starts afresh
    for agent in agents:
        agent.start()
    runner.start()
    bar = tqdm(total=config.rounds, desc=f"simulate {config.algorithm}", unit="round", disable=not progress)
    try:
        while not runner.poll(0):
            for agent in agents:
                agent.poll(0)
            closed = min(len(runner.state.history), config.rounds)
            if closed > bar.n:
                bar.update(closed - bar.n)
    finally:
        bar.close()
        for agent in agents:
            agent.close()
        runner.close()
    return finish_report(config, json.loads((config.out_dir / "report.json").read_text()))


def finish_report(config: SimulationConfig, report: dict[str, Any]) -> dict[str, Any]:
    """What only a simulation can add to a run's report (it holds every site's data): for regression, the
    constant-predictor baseline (`constant_baseline`). Rewrites report.json and report.md, and writes
    per_site.csv (every site's final metrics; report.md summarises when there are many sites)."""
    import json

    from ps_daemon.report import per_site_csv, render_markdown

    baseline = constant_baseline(config)
    if baseline is not None:
        report = {**report, "baseline": baseline}
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(render_markdown(report))
    (out / "per_site.csv").write_text(per_site_csv(report))
    return report


def constant_baseline(config: SimulationConfig) -> dict[str, Any] | None:
    """Regression only: every site's val/test metrics when predicting the pooled training mean for all.

    A regression model that does not beat this learnt nothing from the features (e.g. length of stay
    predicted at its average); the report shows both side by side. None for classification tasks.
    """
    import numpy as np

    from fedmqtt.means import mean_defined
    from fedmqtt.metrics import task_metrics
    from site_agent.data import load_site_data

    sites = sorted(config.sites.items())
    first = load_site_data(sites[0][1])  # the task, before loading every site for nothing
    task = first.task
    if task.kind != "regression":
        return None
    data = {sites[0][0]: first, **{site: load_site_data(spec) for site, spec in sites[1:]}}
    y_train = np.concatenate([np.asarray(d.y_train, dtype=np.float64).reshape(-1) for d in data.values()])
    level = float(np.nanmean(y_train))
    per_site: dict[str, Any] = {}
    for site, d in data.items():
        metrics = {}
        for split in ("val", "test"):
            y = np.asarray(getattr(d, f"y_{split}"), dtype=np.float64).reshape(-1)
            y = y[np.isfinite(y)]
            metrics[split] = task_metrics(task, y, np.full(y.shape, level))[0]
        per_site[site] = {"metrics": metrics}
    mean = {split: {k: mean_defined(e["metrics"][split].get(k) for e in per_site.values())
                    for k in sorted({k for e in per_site.values() for k in e["metrics"][split]})}
            for split in ("val", "test")}
    return {"what": f"constant prediction, the pooled training mean {level:.4g}", "level": level,
            "per_site": per_site, "mean": mean}


def pretrain_pooled(config: SimulationConfig, *, epochs: int = 20) -> Path:
    """Train the model on a stratified `pretrain_fraction` of every site's training rows, pooled.

    Only a simulation can do this (seed 001 pretrains AdaFed's model so); in a hospital network the
    pretrained model must come from outside the federation. Written to out_dir/pretrained.safetensors.
    """
    import numpy as np
    from safetensors.numpy import save_file
    from sklearn.model_selection import train_test_split

    from fedmqtt.data.base import BINARY
    from fedmqtt.training.loop import derive_seed, train_local
    from fedmqtt.training.models import build_model
    from fedmqtt.training.weights import initial_arrays, load_arrays, state_to_arrays
    from site_agent.data import load_site_data

    xs, ys = [], []
    task = BINARY
    for site, spec in sorted(config.sites.items()):
        data = load_site_data(spec)
        task = data.task
        _, counts = np.unique(data.y_train, return_counts=True)
        # Stratify where every class has two rows; under extreme label skew some classes have one.
        stratify = data.y_train if data.task.kind in ("binary", "multiclass") and counts.min() >= 2 else None
        if len(data.y_train) * config.pretrain_fraction < 1:  # a tiny site: too few rows to sample from
            continue
        x, _, y, _ = train_test_split(data.x_train, data.y_train, train_size=config.pretrain_fraction,
                                      random_state=config.seed, stratify=stratify)
        xs.append(x)
        ys.append(y)
    import torch

    torch.set_num_threads(1)  # the same bits whatever ran before in this process
    model = build_model(config.model.name, dict(config.model.args))
    load_arrays(model, initial_arrays(config.model.name, dict(config.model.args), config.seed))
    settings = config.train.model_copy(update={"epochs": epochs})
    train_local(model, np.concatenate(xs), np.concatenate(ys), settings, seed=derive_seed(config.seed, "pretrain", 0),
                task=task)
    path = config.out_dir / "pretrained.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state_to_arrays(model), str(path))
    return path
