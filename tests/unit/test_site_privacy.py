"""The site agent's refusals before training (site_agent/agent.py `_refusal`): its policy's epsilon budget judged
ahead by the accountant on its ledger, a model DP cannot train, a damaged ledger; and the ledger kept when the PS
starts a new run (the rest of the site's state is cleared)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pytest

pytest.importorskip("opacus")

from fedmqtt.data.spec import DataSpec  # noqa: E402
from fedmqtt.training.privacy import epsilon  # noqa: E402
from fedmqtt.transport.signing import FederationKeys  # noqa: E402
from schemas import messages as m  # noqa: E402
from site_agent.agent import SiteAgent  # noqa: E402
from site_agent.config import SiteConfig  # noqa: E402
from site_agent.policy import PrivacyPolicy  # noqa: E402
from site_agent.privacy_ledger import PrivacyLedger  # noqa: E402

DP = m.RecordDP(max_grad_norm=1.0, noise_multiplier=1.0, delta=1e-5)


def _agent(tmp_path: Path, policy: PrivacyPolicy) -> SiteAgent:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 2))
    path = tmp_path / "h1.csv"
    path.write_text("a,b,y\n" + "".join(f"{a:.5f},{b:.5f},{int(a > 0)}\n" for a, b in x))
    spec = {"label": "y", "task": "binary", "numeric": ["a", "b"]}
    data = DataSpec(format="table", path=path, options={"spec": spec})
    config = SiteConfig(site_id="h1", run_id="r", credentials=tmp_path / "none.toml", state_dir=tmp_path / "state",
                        data=data, device="cpu", privacy=policy)
    return SiteAgent(config, identity=FederationKeys("r", ["ps", "h1"]).identity("h1"))


def _task(round_no: int = 1, norm: str = "none", **settings: object) -> tuple[m.TrainTask, m.GlobalModel]:
    spec = m.ModelSpec(name="mlp", args={"in_features": 2, "hidden": [4], "norm": norm})
    task = m.TrainTask(run_id="r", sender="ps", round=round_no, site_id="h1", model_hash="h", deadline=0.0,
                       settings=m.TrainSettings(batch_size=10, **settings))  # type: ignore[arg-type]
    return task, m.GlobalModel(run_id="r", sender="ps", round=round_no, model=spec, model_hash="h", tensors=())


def test_the_budget_is_judged_ahead_on_the_ledger(tmp_path: Path) -> None:
    # 60 training rows, batch 10: q = 1/6, 6 steps a round
    one_round, two_rounds = epsilon([(1.0, 1 / 6, 6)], 1e-5), epsilon([(1.0, 1 / 6, 12)], 1e-5)
    budget = (one_round + two_rounds) / 2
    agent = _agent(tmp_path, PrivacyPolicy(max_epsilon=budget))
    assert agent.trainer.records() == 60
    assert agent._refusal(*_task(dp=DP)) is None
    agent.ledger.save([(1.0, 1 / 6, 6)])  # round 1 was trained: round 2 would pass the budget
    why = agent._refusal(*_task(2, dp=DP))
    assert why is not None and f"round 2 would bring epsilon to {two_rounds:.3g}" in why
    assert f"spent so far {one_round:.3g}" in why and f"max_epsilon {budget:g}" in why
    assert agent._refusal(*_task(2)) is not None  # without DP: refused too (a budget needs DP)


def test_a_model_dp_cannot_train_is_refused_with_the_fix(tmp_path: Path) -> None:
    why = _agent(tmp_path, PrivacyPolicy())._refusal(*_task(norm="bn", dp=DP))
    assert why is not None and why.startswith("cannot train with record-level DP") and "GroupNorm" in why


def test_a_damaged_ledger_refuses_dp_rounds_and_is_left_as_it_is(tmp_path: Path) -> None:
    agent = _agent(tmp_path, PrivacyPolicy())
    agent.ledger.path.parent.mkdir(parents=True, exist_ok=True)
    agent.ledger.path.write_text("{truncated")
    why = agent._refusal(*_task(dp=DP))
    assert why is not None and "damaged" in why and "restored from a backup" in why
    assert agent._refusal(*_task()) is None  # plain training does not read the ledger
    assert agent.ledger.path.read_text() == "{truncated"


def test_a_new_run_clears_the_sites_state_but_not_its_ledger(tmp_path: Path) -> None:
    agent = _agent(tmp_path, PrivacyPolicy())
    agent._join("aa")
    agent.ledger.save([(1.0, 0.1, 30)])
    agent.store.save("update", 1, "h" * 16, b"payload")
    agent._join("bb")  # the PS started afresh
    assert PrivacyLedger(tmp_path / "state" / "privacy").history() == [(1.0, 0.1, 30)]
    assert agent.store.load("update", 1, "h" * 16) is None


def test_a_target_epsilon_the_rdp_accountant_cannot_reach_is_refused_with_the_fix(tmp_path: Path) -> None:
    """epsilon 0.1 at delta 1e-5: Opacus' RDP orders (up to 63) cannot certify it for any noise; the site refuses
    the round with the reason (answered, not a task error the PS re-sends forever), and PRV trains it."""
    def dp(accountant: Literal["rdp", "prv"]) -> m.RecordDP:
        return m.RecordDP(max_grad_norm=1.0, target_epsilon=0.1, delta=1e-5, planned_rounds=10, accountant=accountant)

    agent = _agent(tmp_path, PrivacyPolicy())
    why = agent._refusal(*_task(dp=dp("rdp")))
    assert why is not None and "cannot train with record-level DP" in why and 'accountant = "prv"' in why
    assert agent._refusal(*_task(dp=dp("prv"))) is None
