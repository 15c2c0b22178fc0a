"""Local optimiser settings reach the site's torch optimiser unchanged; FedNova's ||a_i||_1 follows them;
FedDyn clips local gradients; algorithm-aware simulation defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedmqtt.errors import ConfigError  # noqa: E402
from fedmqtt.simulation import (  # noqa: E402
    DEFAULT_PRETRAIN_FRACTION,
    SGD_TRAIN,
    SimulationConfig,
    load_simulation_config,
    run_simulation,
)
from fedmqtt.strategies import build_strategy  # noqa: E402
from fedmqtt.strategies.fednova import a_norm_momentum  # noqa: E402
from fedmqtt.training import client_rules, loop  # noqa: E402
from fedmqtt.training.client_rules import GradTerms, fednova_a_norm, plan_terms  # noqa: E402
from fedmqtt.training.optimisers import LocalOptimiser  # noqa: E402
from schemas.messages import TrainSettings  # noqa: E402


def _spy(monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict[str, Any]], list[tuple[Any, ...]]]:
    """Record every site optimiser's settings and every FedNova ||a_i||_1 computed, without changing them."""
    optimisers: list[dict[str, Any]] = []
    norms: list[tuple[Any, ...]] = []
    make, a_norm = loop._make_optimizer, client_rules.fednova_a_norm

    def record_optimiser(params: Any, settings: TrainSettings) -> LocalOptimiser:
        opt = make(params, settings)
        optimisers.append({"type": opt.name, **opt.defaults})
        return opt

    def record_norm(steps: int, **kw: Any) -> float:
        value = a_norm(steps, **kw)
        norms.append((steps, kw, value))
        return value

    monkeypatch.setattr(loop, "_make_optimizer", record_optimiser)
    monkeypatch.setattr(client_rules, "fednova_a_norm", record_norm)
    return optimisers, norms


def test_fednova_paper_momentum_reaches_every_site_and_its_a_norm(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`--hyper momentum=0.9` (FedNova's paper setting) and train.weight_decay arrive in the site's SGD;
    the a_norm each site sends is the heavy-ball ||a_i||_1 for the momentum its optimiser used."""
    optimisers, norms = _spy(monkeypatch)
    train = SGD_TRAIN.model_copy(update={"weight_decay": 5e-4, "lr": 0.02})
    cfg = SimulationConfig(algorithm="fednova", rounds=1, hyper={"momentum": 0.9}, train=train,
                           out_dir=tmp_path / "run")
    run_simulation(cfg, progress=False)
    assert len(optimisers) == 4 and len(norms) == 4  # one per hospital
    for opt in optimisers:
        assert opt["type"] == "SGD" and opt["momentum"] == 0.9 and opt["nesterov"] is False
        assert opt["lr"] == 0.02 and opt["weight_decay"] == 5e-4
    for steps, kw, value in norms:
        assert kw["rho"] == 0.9 and steps > 1
        assert value == pytest.approx(a_norm_momentum(steps, 0.9), rel=1e-12) and value > steps


def test_train_hyper_survives_the_ps_merge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.hyper momentum/nesterov (no strategy knows them) are not overwritten by the strategy's hyper."""
    optimisers, _ = _spy(monkeypatch)
    train = SGD_TRAIN.model_copy(update={"hyper": {"momentum": 0.5, "nesterov": 1.0}})
    cfg = SimulationConfig(algorithm="fedprox", rounds=1, hyper={"mu": 0.01}, train=train, out_dir=tmp_path / "r")
    run_simulation(cfg, progress=False)
    assert [(o["momentum"], o["nesterov"]) for o in optimisers] == [(0.5, True)] * 4


@pytest.mark.parametrize("rho,nesterov", [(0.0, False), (0.9, False), (0.5, True), (0.9, True)])
def test_a_norm_is_the_displacement_of_torch_sgd_under_a_constant_gradient(rho: float, nesterov: bool) -> None:
    """With every gradient equal to 1, the site's SGD moves by exactly lr * ||a||_1 after tau steps."""
    w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = LocalOptimiser([w], "sgd", lr=0.1, momentum=rho, nesterov=nesterov)
    for _ in range(7):
        opt.zero_grad()
        w.sum().backward()
        opt.step()
    assert -float(w.detach()) == pytest.approx(0.1 * fednova_a_norm(7, lr=0.1, rho=rho, nesterov=nesterov), rel=1e-12)


def test_local_optimiser_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="momentum must be in"):
        build_strategy("fednova", {"momentum": 1.5})
    with pytest.raises(ConfigError, match="nesterov = 1 needs momentum"):
        build_strategy("fedavg", {"nesterov": 1})
    with pytest.raises(ConfigError, match="--optimizer sgd"):
        SimulationConfig(algorithm="fedavg", hyper={"momentum": 0.9}).daemon_config()
    with pytest.raises(ConfigError, match="move mu to `hyper`"):
        SimulationConfig(algorithm="fedprox", train=TrainSettings(hyper={"mu": 0.1})).daemon_config()
    with pytest.raises(ConfigError, match="scaffold needs SGD without momentum"):
        SimulationConfig(algorithm="scaffold", hyper={"momentum": 0.9}).daemon_config()
    with pytest.raises(ValueError, match="settings of SGD"):
        loop._make_optimizer([torch.nn.Parameter(torch.zeros(1))],
                             TrainSettings(optimizer="adam", hyper={"momentum": 0.9}))


def test_feddyn_clips_local_gradients_at_the_papers_norm() -> None:
    """Default max_grad_norm 10 reaches the site (site_hyper -> plan_terms) and bounds one SGD step."""
    rule = build_strategy("feddyn", {"alpha": 0.01})
    hyper = rule.site_hyper("a", {"a": 10})
    settings = TrainSettings(algorithm="feddyn", optimizer="sgd", lr=1.0, hyper=hyper)
    manifest = {"weight": {"shape": [1, 4], "dtype": "float32", "tags": ["TRAIN"]},
                "bias": {"shape": [1], "dtype": "float32", "tags": ["TRAIN"]}}
    terms = plan_terms(settings, manifest, extras={}, local={})
    assert terms.clip_norm == 10.0
    x = np.full((8, 4), 100.0, np.float32)
    y = np.full(8, 1e4, np.float32)
    moved = {}
    from fedmqtt.data.base import TaskInfo

    for clip in (0.0, 10.0):
        model = torch.nn.Linear(4, 1)
        torch.nn.init.zeros_(model.weight)
        torch.nn.init.zeros_(model.bias)
        loop.train_local(model, x, y, settings.model_copy(update={"batch_size": 8}), seed=0,
                         terms=GradTerms(dyn_alpha=0.01, dyn_s={}, clip_norm=clip),
                         task=TaskInfo("regression", 1, ("y",)))
        moved[clip] = float(torch.cat([model.weight.flatten(), model.bias]).detach().norm())
    assert moved[10.0] == pytest.approx(10.0, rel=1e-5) and moved[0.0] > 1e3
    off = build_strategy("feddyn", {"alpha": 0.01, "max_grad_norm": 0}).site_hyper("a", {"a": 10})
    assert plan_terms(settings.model_copy(update={"hyper": off}), manifest, extras={}, local={}).clip_norm == 0


def test_algorithm_aware_simulation_defaults() -> None:
    """SCAFFOLD/FedNova get SGD when train was left alone; a user's Adam is an error naming the fix;
    AdaFed gets a BatchNorm model and pretraining; other algorithms keep the defaults bit for bit."""
    for algorithm in ("scaffold", "fednova"):
        cfg = load_simulation_config(None, algorithm=algorithm)
        assert cfg.train == SGD_TRAIN
        cfg.daemon_config()
        chosen = cfg.model_validate({**cfg.model_dump(), "train": {**SGD_TRAIN.model_dump(), "optimizer": "adam"}})
        with pytest.raises(ConfigError, match='train.optimizer = "sgd"'):
            chosen.daemon_config()
    for algorithm in ("adafed", "d-adafed"):
        cfg = load_simulation_config(None, algorithm=algorithm)
        assert cfg.pretrain_fraction == DEFAULT_PRETRAIN_FRACTION
        cfg.daemon_config()
    assert load_simulation_config(None, algorithm="adafed").model.args["norm"] == "bn"
    assert load_simulation_config(None, algorithm="fedavg") == SimulationConfig()


def test_grid_points_get_the_algorithm_defaults(tmp_path: Path) -> None:
    """A grid naming scaffold, fednova and d-adafed with no train settings runs them, as simulate does."""
    from fedmqtt.experiments.grid import expand, load_grid, point_to_simulation_config

    path = tmp_path / "grid.toml"
    path.write_text('algorithms = ["scaffold", "fednova", "d-adafed", "fedavg"]\n[base]\nrounds = 1\n')
    configs = {p.algorithm.name: point_to_simulation_config(p, tmp_path / "out") for p in expand(load_grid(path))}
    assert configs["scaffold"].train == configs["fednova"].train == SGD_TRAIN
    assert configs["d-adafed"].pretrain_fraction == DEFAULT_PRETRAIN_FRACTION
    assert configs["fedavg"].train == SimulationConfig().train and configs["fedavg"].pretrain_fraction is None
    for cfg in configs.values():
        cfg.daemon_config()
