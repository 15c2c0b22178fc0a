"""The label histogram released with Laplace noise (fedmqtt/training/histogram_dp.py, site_agent/histogram_release.py):
the scale is Delta_1 / epsilon, the noise has the Laplace distribution's variance and tails (not a Gaussian's of the
same variance), the ledger charges it as a pure-epsilon entry once, and every epsilon the site judges adds the pure
releases to the Gaussian history's (basic composition, site_agent/privacy_ledger.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_histogram_dp import EXACT, _agent

from fedmqtt.training.histogram_dp import l1_sensitivity, laplace_scale, noised_histogram
from fedmqtt.training.privacy import epsilon
from schemas.messages import GlobalModel, ModelSpec, PrivacyPolicy, RecordDP, TrainSettings, TrainTask
from site_agent.histogram_release import RELEASE_FILE, HistogramRelease
from site_agent.privacy_ledger import LedgerError, PrivacyLedger

LAPLACE = PrivacyPolicy(label_histogram_epsilon=1.0, label_histogram_noise="laplace")


@pytest.mark.parametrize(("eps", "kind", "bins", "scale"), [
    (1.0, "binary", 2, 1.0), (0.5, "multiclass", 5, 2.0), (0.1, "binary", 2, 10.0), (2.0, "multilabel", 4, 2.0)])
def test_the_scale_is_the_l1_sensitivity_over_epsilon(eps: float, kind: str, bins: int, scale: float) -> None:
    assert laplace_scale(eps, kind, bins) == pytest.approx(scale)
    assert l1_sensitivity(kind, bins) == (bins if kind == "multilabel" else 1.0)
    with pytest.raises(ValueError, match="positive epsilon"):
        laplace_scale(0.0, kind, bins)


def test_the_noise_has_laplaces_variance_and_tails() -> None:
    """100 000 counts far from 0 (no clamping): the noise's variance is 2 b^2 plus the rounding's 1/12, its excess
    kurtosis 3 (a Gaussian's is 0), and P(|noise| > 5 b) about e^-5 (a Gaussian of that variance: 0.02 %)."""
    b, n = laplace_scale(0.5, "binary", 2), 100_000
    counts = {str(i): 1000 for i in range(n)}
    noised = noised_histogram(counts, b, np.random.default_rng(7), "laplace")
    noise = np.array([noised[k] - 1000 for k in counts], dtype=np.float64)
    assert abs(noise.mean()) < 5 * math.sqrt(2 * b * b / n)
    assert noise.var() == pytest.approx(2 * b * b + 1 / 12, rel=0.03)
    kurtosis = float(np.mean((noise - noise.mean()) ** 4) / noise.var() ** 2 - 3)
    assert kurtosis == pytest.approx(3.0, abs=0.3)
    tail = math.exp(-(5 * b + 0.5) / b)  # P(|raw noise| >= 5 b + 1/2): what rounds beyond 5 b
    assert np.mean(np.abs(noise) > 5 * b + 0.5) == pytest.approx(tail, rel=0.15)
    gaussian = noised_histogram(counts, b * math.sqrt(2), np.random.default_rng(7))  # the same variance
    tails = np.mean(np.abs(np.array([gaussian[k] - 1000 for k in counts])) > 5 * b + 0.5)
    assert tails < 0.2 * tail  # the check tells the two apart


def test_released_once_charged_once_as_pure_epsilon(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path)
    first = HistogramRelease(tmp_path).shared(EXACT, LAPLACE, "binary", ledger)
    assert first is not None and first.keys() == EXACT.keys()
    assert ledger.pure_epsilon() == 1.0 and ledger.history() == []  # no Gaussian step, no delta
    kept = json.loads((tmp_path / RELEASE_FILE).read_text())
    assert kept["mechanism"] == "laplace" and kept["noise_multiplier"] == pytest.approx(1.0)  # b / Delta_1
    assert HistogramRelease(tmp_path).shared(EXACT, LAPLACE, "binary", ledger) == first  # a restart: the same
    assert ledger.pure_epsilon() == 1.0  # nothing spent again
    gaussian = PrivacyPolicy(label_histogram_epsilon=1.0)  # another mechanism: a new release, charged
    HistogramRelease(tmp_path).shared(EXACT, gaussian, "binary", ledger)
    assert len(ledger.history()) == 1 and ledger.pure_epsilon() == 1.0


def test_the_budget_adds_the_pure_release_to_the_gaussian_history(tmp_path: Path) -> None:
    spent = epsilon([(1.0, 0.1, 100)], 1e-5)
    ledger = PrivacyLedger(tmp_path)
    ledger.save([(1.0, 0.1, 100)])
    tight = PrivacyPolicy(label_histogram_epsilon=1.0, label_histogram_noise="laplace", max_epsilon=spent + 0.99)
    assert HistogramRelease(tmp_path).shared(EXACT, tight, "binary", ledger) is None
    assert ledger.pure_epsilon() == 0.0
    room = tight.model_copy(update={"max_epsilon": spent + 1.01})
    assert HistogramRelease(tmp_path).shared(EXACT, room, "binary", ledger) is not None
    assert ledger.pure_epsilon() == 1.0 and ledger.history() == [(1.0, 0.1, 100)]


def test_the_ledger_keeps_both_kinds_and_refuses_a_damaged_pure_entry(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path)
    ledger.path.parent.mkdir(parents=True, exist_ok=True)
    ledger.path.write_text(json.dumps({"version": 1, "history": [[1.0, 0.5, 3]]}))  # written before pure entries
    assert ledger.history() == [(1.0, 0.5, 3)] and ledger.pure_epsilon() == 0.0
    ledger.charge_pure(0.5)
    ledger.save([(1.0, 0.5, 3), (2.0, 0.5, 4)])  # a DP-SGD round after it keeps the pure entry
    assert ledger.pure_epsilon() == 0.5 and len(ledger.history()) == 2
    ledger.path.write_text(json.dumps({"version": 1, "history": [], "pure": [-1.0]}))
    with pytest.raises(LedgerError, match="damaged"):
        ledger.pure_epsilon()


def test_the_sites_record_level_budget_counts_the_laplace_release(tmp_path: Path) -> None:
    """A DP-SGD round whose own epsilon fits max_epsilon is refused once the Laplace release's epsilon is added."""
    dp = RecordDP(max_grad_norm=1.0, noise_multiplier=1.0, delta=1e-5)
    task = TrainTask(run_id="r", sender="ps", round=1, site_id="h1", model_hash="h", deadline=0.0,
                     settings=TrainSettings(dp=dp, batch_size=20, optimizer="sgd"))
    model = GlobalModel(run_id="r", sender="ps", round=1, model=ModelSpec(name="mlp", args={"in_features": 2}),
                        model_hash="h", tensors=())
    probe = _agent(tmp_path / "probe", PrivacyPolicy(), share=False)
    _, plan = probe.trainer.dp_plan(model.model, task.settings, [])
    assert plan is not None
    policy = LAPLACE.model_copy(update={"max_epsilon": plan.epsilon_after + 0.5})
    assert _agent(tmp_path / "plain", policy, share=False)._refusal(task, model) is None
    agent = _agent(tmp_path / "released", policy)
    assert agent._status("online").label_histogram is not None and agent.ledger.pure_epsilon() == 1.0
    why = agent._refusal(task, model)
    assert why is not None and f"bring epsilon to {plan.epsilon_after + 1.0:.3g}" in why
