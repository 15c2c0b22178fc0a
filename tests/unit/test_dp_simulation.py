"""Record-level DP through the whole federation (in-process simulation, the deployment's code path): every site
trains with DP-SGD and its epsilon reaches the report; a model Opacus cannot clip per record is refused by every
site with the fix; a config whose algorithm cannot train under DP never starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

pytest.importorskip("opacus")

from fedmqtt.data.spec import DataSpec  # noqa: E402
from fedmqtt.simulation import SimulationConfig, run_simulation  # noqa: E402
from fedmqtt.training.privacy import epsilon  # noqa: E402
from ps_daemon.config import DaemonConfig  # noqa: E402
from schemas import messages as m  # noqa: E402
from site_agent.privacy_ledger import PrivacyLedger  # noqa: E402

DP = m.RecordDP(max_grad_norm=1.0, noise_multiplier=1.1, delta=1e-4)


def _csv(path: Path, rows: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 2))
    y = (x[:, 0] > 0).astype(int)
    path.write_text("a,b,y\n" + "".join(f"{a:.6f},{b:.6f},{t}\n" for (a, b), t in zip(x, y, strict=True)))
    return path


def _config(tmp_path: Path, norm: str) -> SimulationConfig:
    spec = {"label": "y", "task": "binary", "numeric": ["a", "b"]}
    sites = {s: DataSpec(format="table", path=_csv(tmp_path / f"{s}.csv", 80, k), options={"spec": spec})
             for k, s in enumerate(("h1", "h2"))}
    model = m.ModelSpec(name="mlp", args={"in_features": 2, "hidden": [8], "norm": norm})
    return SimulationConfig(rounds=2, sites=sites, out_dir=tmp_path / "out", model=model,
                            train=m.TrainSettings(epochs=2, batch_size=8, lr=0.05, optimizer="sgd", dp=DP))


@pytest.mark.timeout(180)
def test_every_site_trains_with_dp_and_its_epsilon_reaches_the_report(tmp_path: Path) -> None:
    report = run_simulation(_config(tmp_path, "gn"), progress=False)
    assert [r["sites"] for r in report["rounds"]] == [["h1", "h2"], ["h1", "h2"]]
    assert all(r["train_loss"] is None for r in report["rounds"])  # the loss stays at the sites under DP
    spent = report["privacy"]["record_level"]
    assert set(spent) == {"h1", "h2"}
    for site in ("h1", "h2"):
        s = spent[site]
        # 48 training rows (60 % of 80), batch 8: q = 1/6, 12 steps a round, two rounds
        assert s["sample_rate"] == pytest.approx(1 / 6) and s["steps"] == 24
        assert s["epsilon"] == pytest.approx(epsilon([(1.1, 1 / 6, 24)], 1e-4))
        ledger = PrivacyLedger(tmp_path / "out" / "state" / site / "privacy").history()
        assert ledger == [pytest.approx((1.1, 1 / 6, 24))]


@pytest.mark.timeout(180)
def test_a_batchnorm_model_is_refused_by_every_site_with_the_fix(tmp_path: Path) -> None:
    report = run_simulation(_config(tmp_path, "bn"), progress=False)
    assert [r["sites"] for r in report["rounds"]] == [[], []]
    for r in report["rounds"]:
        for why in r["skipped"].values():
            assert "cannot train with record-level DP" in why and "GroupNorm" in why
    assert report["privacy"]["record_level"] == {}


@pytest.mark.parametrize(("algorithm", "hyper"), [("fedprox", {"mu": 0.1}), ("scaffold", {}),
                                                  ("fedavg", {"balance_classes": 1.0})])
def test_a_config_whose_local_step_cannot_be_dp_never_starts(algorithm: str, hyper: dict[str, float]) -> None:
    train = {"dp": DP.model_dump(), **({"optimizer": "sgd"} if algorithm == "scaffold" else {})}
    with pytest.raises(ValidationError, match="train.dp: record-level DP"):
        DaemonConfig.model_validate({"run_id": "r", "sites": ["a"], "model": {"name": "mlp"}, "credentials": "c.toml",
                                     "algorithm": algorithm, "hyper": hyper, "train": train})


def test_a_target_epsilon_is_spread_over_the_runs_rounds() -> None:
    config = DaemonConfig.model_validate({
        "run_id": "r", "sites": ["a"], "model": {"name": "mlp"}, "credentials": "c.toml", "rounds": 7,
        "train": {"dp": {"max_grad_norm": 1.0, "target_epsilon": 2.0}}})
    dp = config.record_dp()
    assert dp is not None and dp.planned_rounds == 7 and dp.target_epsilon == 2.0

