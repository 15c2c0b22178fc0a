"""A site that cannot take a single optimiser step (one training row, no labelled row) says so, with the reason,
and the round goes on without it: counted as answered, left out of the aggregate, named in the round record.
Before, its zero-step update was refused: each round waited for its deadline, re-publishing the task every stall_s,
and for ever where the quorum needed that site."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from fedmqtt.data.spec import DataSpec
from fedmqtt.simulation import SimulationConfig, run_simulation
from fedmqtt.strategies import SiteUpdate, build_strategy
from fedmqtt.training.loop import train_local
from fedmqtt.training.models import build_model
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SiteOnline, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.runner import hash_weights
from schemas import messages as m
from schemas.codec import decode, encode
from schemas.tensors import arrays_to_blobs
from site_agent.data import load_site_data

MLP = {"in_features": 2, "hidden": [4], "norm": "none"}
WEIGHTS = {"fc.weight": np.zeros((2, 3), np.float32), "fc.bias": np.zeros(2, np.float32)}
WHY = "1 labelled training row, and with batch_size 8 a trailing batch of one row is dropped"


def test_one_row_or_no_labelled_row_takes_no_step_and_says_why() -> None:
    # Prepare
    settings = m.TrainSettings(batch_size=8, epochs=3)
    one = (np.ones((1, 2)), np.ones(1))
    unlabelled = (np.ones((4, 2)), np.full(4, np.nan))
    # Execute
    stats = [train_local(build_model("mlp", MLP), x, y, settings, seed=0) for x, y in (one, unlabelled)]
    trained = train_local(build_model("mlp", MLP), np.ones((2, 2)), np.array([0.0, 1.0]), settings, seed=0)
    # Assert
    assert [(s.steps, s.n_samples, s.mean_loss) for s in stats] == [(0, 1, None), (0, 0, None)]
    assert stats[0].no_step_reason.startswith(WHY)
    assert stats[1].no_step_reason == "no labelled training row"
    assert trained.steps == 3 and trained.no_step_reason == ""


def _answer(**changes: Any) -> m.ClientUpdate:
    fields: dict[str, Any] = dict(run_id="r1", sender="site-b", round=1, base_model_hash="h", tensors=(),
                                  n_samples=1, local_steps=0, no_step_reason=WHY)
    return m.ClientUpdate(**{**fields, **changes})


def test_the_wire_carries_a_no_step_answer_and_nothing_to_aggregate_with_it() -> None:
    answer = _answer(val_metrics={"auroc": None}, label_histogram={"1": 1})
    assert decode(encode(answer)) == answer
    for changes in ({"local_steps": 1}, {"tensors": arrays_to_blobs(WEIGHTS)}, {"scalars": {"a_norm": 1.0}},
                    {"control_variates": arrays_to_blobs(WEIGHTS)}):
        with pytest.raises(ValidationError, match="no_step_reason"):
            _answer(**changes)


def _machine() -> tuple[Machine, Any]:
    config = DaemonConfig.model_validate({"run_id": "r1", "sites": ["site-a", "site-b"], "model": {"name": "mlp"},
                                          "credentials": "c.toml", "algorithm": "fedavg", "rounds": 2})
    machine = Machine(config, build_strategy("fedavg", config.strategy_params()), hash_weights)
    state = machine.initial_state(dict(WEIGHTS), session="5e55")
    for site in ("site-a", "site-b"):
        state, _ = machine.step(state, SiteOnline(site, now=0.0, n_train=10))
    return machine, state


def test_the_ps_closes_the_round_without_the_site_that_took_no_step() -> None:
    # Prepare
    machine, state = _machine()
    trained = {n: np.full_like(v, 2.0) for n, v in WEIGHTS.items()}
    # Execute: the answer first, so the round cannot close before both are in
    state, said = machine.step(state, UpdateReceived("site-b", 1.0, 1, state.model_hash,
                                                     SiteUpdate("site-b", {}, 1, 0), no_step_reason=WHY))
    waiting = state.round
    state, _ = machine.step(state, UpdateReceived("site-a", 2.0, 1, state.model_hash,
                                                  SiteUpdate("site-a", trained, 10, 3)))
    # Assert
    assert waiting == 1 and any(WHY in getattr(e, "text", "") for e in said)
    assert state.round == 2 and len(state.history) == 1
    record = state.history[0]
    assert record.sites == ("site-a",) and record.skipped == {"site-b": WHY} and record.stragglers == ()
    assert state.accepted_rounds == {"site-a": 1}  # site-b's (unchanged) state is not committed
    for name, value in trained.items():
        np.testing.assert_array_equal(state.weights[name], value)  # the aggregate is site-a's alone


def _csv(path: Path, rows: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 2))
    y = (x[:, 0] > 0).astype(int)
    y[:2] = (0, 1)
    path.write_text("a,b,y\n" + "".join(f"{a:.6f},{b:.6f},{t}\n" for (a, b), t in zip(x, y, strict=True)))
    return path


@pytest.mark.timeout(120)  # before the fix each round waited for its 300 s deadline
def test_a_simulation_with_a_one_row_site_finishes_and_reports_it(tmp_path: Path) -> None:
    # Prepare: h2 keeps 1 of its 3 rows for training
    spec = {"label": "y", "task": "binary", "numeric": ["a", "b"]}
    sites = {"h1": DataSpec(format="table", path=_csv(tmp_path / "h1.csv", 30, 0), options={"spec": spec}),
             "h2": DataSpec(format="table", path=_csv(tmp_path / "h2.csv", 3, 1), options={"spec": spec},
                            fractions=(0.34, 0.33, 0.33))}
    assert load_site_data(sites["h2"]).n_train == 1
    cfg = SimulationConfig(rounds=2, sites=sites, out_dir=tmp_path / "out", model=m.ModelSpec(name="mlp", args=MLP),
                           train=m.TrainSettings(epochs=1, batch_size=8, lr=0.01))
    # Execute
    report = run_simulation(cfg, progress=False)
    # Assert
    assert [r["sites"] for r in report["rounds"]] == [["h1"], ["h1"]]
    assert all(r["skipped"]["h2"].startswith(WHY) for r in report["rounds"])
    assert set(report["final"]["per_site"]) == {"h1", "h2"}  # the site still evaluates the final model


def test_a_round_in_which_no_site_could_train_closes_with_the_model_unchanged() -> None:
    # Prepare
    machine, state = _machine()
    before = dict(state.weights)
    # Execute
    for site in ("site-a", "site-b"):
        state, _ = machine.step(state, UpdateReceived(site, 1.0, 1, state.model_hash, SiteUpdate(site, {}, 0, 0),
                                                      no_step_reason="no labelled training row"))
    # Assert
    assert state.round == 2 and state.history[0].sites == () and set(state.history[0].skipped) == {"site-a", "site-b"}
    for name, value in before.items():
        np.testing.assert_array_equal(state.weights[name], value)
