"""`fedmqtt simulate`: the PS runner and every site agent in one process, over an in-memory broker.

Same code path as a deployment (state machine, strategies, site training, codec), only the transport
differs, so a simulated run and an MQTT run with the same config and seed end with bit-identical weights
on CPU (tested). The config (SimulationConfig) lives in fedmqtt.simulation_config, which the pooled
baseline (fedmqtt.central) imports too: this module imports central, never the other way round.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from fedmqtt.atomic import volatile_writes
from fedmqtt.data.read_once import shared_datasets
from fedmqtt.simulation_config import (  # re-exported: callers import the config from here too
    DEFAULT_MODEL,
    DEFAULT_PRETRAIN_FRACTION,
    DEFAULT_TRAIN,
    IN_PROCESS,
    SGD_TRAIN,
    SimulationConfig,
    algorithm_defaults,
    bundled_sites,
    load_simulation_config,
)
from fedmqtt.transport.memory import MemoryBroker, MemoryTransport
from fedmqtt.transport.signing import FederationKeys

if TYPE_CHECKING:
    from fedmqtt.data.splits import SiteData
    from fedmqtt.tracking import RunTracker
    from site_agent.agent import SiteAgent

__all__ = ["DEFAULT_MODEL", "DEFAULT_PRETRAIN_FRACTION", "DEFAULT_TRAIN", "IN_PROCESS", "SGD_TRAIN",
           "SimulationConfig", "algorithm_defaults", "bundled_sites", "finish_report", "load_simulation_config",
           "pretrain_pooled", "run_baselines", "run_simulation"]


def run_simulation(config: SimulationConfig, *, progress: bool = True,
                   tracker: RunTracker | None = None) -> dict[str, Any]:
    """Run the whole federation in this process; returns the report (also written to out_dir).

    `algorithm = "central"` is the pooled baseline instead (fedmqtt.central): no federation at all.
    `tracker` (fedmqtt.tracking, opened by the caller, who closes it) gets every round's metrics as the PS
    publishes them and the finished report, baselines included.
    """
    # Every site of a partition, the pretraining and the baselines read the same pooled file: once. Nothing is
    # fsynced: a simulation starts afresh and never resumes (its files are still written atomically).
    with shared_datasets(), volatile_writes():
        return _run(config, progress=progress, tracker=tracker)


def _run(config: SimulationConfig, *, progress: bool, tracker: RunTracker | None) -> dict[str, Any]:
    from fedmqtt.federation_stats import with_federation_statistics

    config = with_federation_statistics(config)  # feature_statistics: the sites' data reads the federation's
    if config.algorithm == "central":
        from fedmqtt.central import run_central

        report = finish_report(config, run_central(config, progress=progress))
        if tracker is not None:
            tracker.run_finished(report, config.out_dir)
        return report
    import json

    from ps_daemon.runner import DaemonRunner
    from site_agent.agent import SiteAgent

    if config.pretrain_fraction is not None and config.pretrained is None:
        config = config.model_copy(update={"pretrained": pretrain_pooled(config)})
    daemon_cfg = config.daemon_config()
    shutil.rmtree(config.out_dir / "state", ignore_errors=True)  # a fresh run: no stored uplinks
    broker = MemoryBroker()

    def factory(**kw: Any) -> MemoryTransport:
        return MemoryTransport(broker, **kw)

    # Every party signs and verifies as in a deployment; the keys live and die with this process.
    site_cfgs = config.site_configs()
    keys = FederationKeys(daemon_cfg.run_id, ["ps", *(cfg.site_id for cfg in site_cfgs)])
    agents = [SiteAgent(cfg, transport_factory=factory, identity=keys.identity(cfg.site_id)) for cfg in site_cfgs]
    runner = DaemonRunner(daemon_cfg, force=True, transport_factory=factory,  # a simulation always starts afresh
                          identity=keys.identity("ps"), on_round=None if tracker is None else tracker.round_closed)
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
    report = finish_report(config, json.loads((config.out_dir / "report.json").read_text()),
                           held=held_site_data(config, agents))
    if tracker is not None:
        tracker.run_finished(report, config.out_dir)
    return report


def held_site_data(config: SimulationConfig, agents: list[SiteAgent]) -> dict[str, SiteData]:
    """The data each agent loaded at its start, for the sites whose agent read exactly the spec the baselines
    would load (a site that took the federation's statistics from another file is loaded again): 20 sites'
    partition selection, splits and normalisation made twice cost about 0.5 s at the end of an OrganAMNIST run.
    Nothing writes into a site's arrays (training and scoring read them)."""
    return {a.config.site_id: a.data for a in agents if a.features.spec() == config.sites.get(a.config.site_id)}


def finish_report(config: SimulationConfig, report: dict[str, Any], *,
                  held: Mapping[str, SiteData] | None = None) -> dict[str, Any]:
    """What only a simulation can add to a run's report (it holds every site's data): the `baselines` the
    model is measured against (`run_baselines`), and every site's data spec (`site_data`). Rewrites
    report.json and report.md, and writes per_site.csv (every site's final metrics; report.md summarises when
    there are many sites)."""
    import json

    from ps_daemon.report import per_site_csv, render_markdown

    report = {**report, **run_baselines(config, report, held=held)}
    # Every site's data spec, so `fedmqtt report --held-out` can score this run on any site's test split.
    site_data = {site: spec.model_dump(mode="json") for site, spec in sorted(config.sites.items())}
    report = {**report, "site_data": site_data}
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(render_markdown(report))
    (out / "per_site.csv").write_text(per_site_csv(report))
    return report


def run_baselines(config: SimulationConfig, report: dict[str, Any], *,
                  held: Mapping[str, SiteData] | None = None) -> dict[str, Any]:
    """The report's `baselines` (fedmqtt.baseline_report): every metric-optimal constant and the pooled
    reference model, fitted on the pooled training rows, and the site-alone predictor, scored on every
    site's val/test split, with warnings where the final model does not beat them. Regression reports
    also keep `baseline` (the pooled training mean), the single entry older readers know. `held`: sites' data
    loaded already from their spec in `config` (`held_site_data`); the others are loaded here."""
    from fedmqtt.baseline_report import baselines_section, legacy_baseline
    from site_agent.data import load_site_data

    held = held or {}
    data = {site: held[site] if site in held else load_site_data(spec) for site, spec in sorted(config.sites.items())}
    model = "the pooled model" if config.algorithm == "central" else "the federated model"
    section = baselines_section(data, report["final"]["mean"].get("test", {}), seed=config.seed, model_name=model)
    legacy = legacy_baseline(section)
    return {"baselines": section, **({"baseline": legacy} if legacy is not None else {})}


def pretrain_pooled(config: SimulationConfig, *, epochs: int = 20, fraction: float | None = None,
                    path: Path | None = None) -> Path:
    """Train the model on a stratified `pretrain_fraction` (or `fraction`; 1: every row) of every site's
    training rows, pooled, starting from the model's seeded initialisation (config.seed).

    Only a simulation can do this (Chen et al. pretrain AdaFed's model so); in a hospital network the
    pretrained model must come from outside the federation: `fedmqtt pretrain` makes one on another data set
    (a run's `init_model`). Written to `path` (default out_dir/pretrained.safetensors).
    """
    import numpy as np
    from safetensors.numpy import save_file
    from sklearn.model_selection import train_test_split

    from fedmqtt.atomic import replace_atomic
    from fedmqtt.data.base import BINARY
    from fedmqtt.training.loop import derive_seed, train_local
    from fedmqtt.training.models import build_model
    from fedmqtt.training.weights import initial_arrays, load_arrays, state_to_arrays
    from site_agent.data import load_site_data

    fraction = config.pretrain_fraction if fraction is None else fraction
    if fraction is None or not 0 < fraction <= 1:
        raise ValueError(f"pretrain_pooled needs a fraction in (0, 1] (config.pretrain_fraction), not {fraction}")
    xs, ys = [], []
    task = BINARY
    for _site, spec in sorted(config.sites.items()):  # in site order: the pooled rows do not depend on dict order
        data = load_site_data(spec)
        task = data.task
        _, counts = np.unique(data.y_train, return_counts=True)
        # Stratify where every class has two rows; under extreme label skew some classes have one.
        stratify = data.y_train if data.task.kind in ("binary", "multiclass") and counts.min() >= 2 else None
        if len(data.y_train) * fraction < 1:  # a tiny site: too few rows to sample from
            continue
        if fraction == 1:  # every row (train_test_split cannot leave nothing out)
            xs.append(data.x_train)
            ys.append(data.y_train)
            continue
        x, _, y, _ = train_test_split(data.x_train, data.y_train, train_size=fraction,
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
    path = config.out_dir / "pretrained.safetensors" if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = state_to_arrays(model)
    # Atomic: a PS or a resumed grid reads this file; an interrupted write must not leave half a model behind.
    return replace_atomic(path, lambda tmp: save_file(arrays, str(tmp)))
