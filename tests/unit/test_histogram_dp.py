"""Label histograms under DP (fedmqtt/training/histogram_dp.py, site_agent/histogram_release.py): the noise spends
at most the policy's epsilon by Opacus' accountants, it has the std it claims, the release is charged to the
ledger once and re-sent as it was (across restarts), and a budget or a damaged ledger stops it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import norm

from fedmqtt.training.histogram_dp import noise_multiplier, noised_histogram, sensitivity
from fedmqtt.training.privacy import epsilon
from schemas.messages import PrivacyPolicy
from site_agent.histogram_release import RELEASE_FILE, HistogramRelease
from site_agent.privacy_ledger import PrivacyLedger

EXACT = {"0": 120, "1": 45}


@pytest.mark.parametrize("eps", [0.5, 1.0, 4.0])
def test_noise_spends_at_most_epsilon_by_both_accountants(eps: float) -> None:
    z = noise_multiplier(eps, 1e-5)
    for kind in ("rdp", "prv"):
        spent = epsilon([(z, 1.0, 1)], 1e-5, kind)
        assert spent <= eps * 1.001, kind
    assert epsilon([(z, 1.0, 1)], 1e-5, "rdp") > eps * 0.98  # and not far less: the larger of the two is taken


@pytest.mark.parametrize("eps", [0.1, 1.0, 4.0])
def test_the_gaussian_mechanism_exact_delta_stays_below_the_target(eps: float) -> None:
    """The exact privacy profile of the Gaussian mechanism (Balle and Wang, Improving the Gaussian mechanism,
    Theorem 8): delta(eps) = Phi(1 / (2 s) - eps s) - e^eps Phi(-1 / (2 s) - eps s) for std s (sensitivity 1)."""
    s = noise_multiplier(eps, 1e-5)
    exact = norm.cdf(1 / (2 * s) - eps * s) - math.exp(eps) * norm.cdf(-1 / (2 * s) - eps * s)
    assert exact <= 1e-5
    assert exact > 1e-7  # calibrated, not wildly over-noised


def test_epsilon_0_1_is_reached_with_prv_where_rdp_cannot() -> None:
    z = noise_multiplier(0.1, 1e-5)
    assert epsilon([(z, 1.0, 1)], 1e-5, "prv") <= 0.1 * 1.001
    assert z > 20  # a release at epsilon 0.1 adds noise of std above 20 records to every count


def test_sensitivity_and_the_noise_it_scales() -> None:
    assert sensitivity("binary", 2) == 1.0 and sensitivity("regression", 10) == 1.0
    assert sensitivity("multilabel", 4) == 2.0  # one record positive in all four labels
    rng = np.random.default_rng(0)
    draws = np.array([noised_histogram({"0": 1000}, 7.0, rng)["0"] for _ in range(4000)])
    assert draws.std() == pytest.approx(7.0, rel=0.05) and abs(draws.mean() - 1000) < 5 * 7 / math.sqrt(4000)
    assert noised_histogram({"0": 0, "1": 1}, 50.0, rng).keys() == {"0", "1"}
    assert min(noised_histogram({"0": 0}, 50.0, rng)["0"] for _ in range(50)) == 0  # clamped, never negative


def test_exact_counts_without_a_policy_epsilon(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path)
    assert HistogramRelease(tmp_path).shared(EXACT, PrivacyPolicy(), "binary", ledger) == EXACT
    assert ledger.history() == [] and not (tmp_path / RELEASE_FILE).exists()


def test_released_once_charged_once_and_resent_after_a_restart(tmp_path: Path) -> None:
    ledger, policy = PrivacyLedger(tmp_path), PrivacyPolicy(label_histogram_epsilon=1.0)
    first = HistogramRelease(tmp_path).shared(EXACT, policy, "binary", ledger)
    assert first is not None and first.keys() == EXACT.keys() and first != EXACT  # noised (std ~4 records)
    z = noise_multiplier(1.0, 1e-5)
    assert ledger.history() == [(pytest.approx(z), 1.0, 1)]
    assert HistogramRelease(tmp_path).shared(EXACT, policy, "binary", ledger) == first  # a restart: the same
    assert len(ledger.history()) == 1  # and nothing spent again
    # another epsilon, or other counts: a new release, charged again
    HistogramRelease(tmp_path).shared(EXACT, PrivacyPolicy(label_histogram_epsilon=2.0), "binary", ledger)
    HistogramRelease(tmp_path).shared({"0": 121, "1": 45}, PrivacyPolicy(label_histogram_epsilon=2.0), "binary",
                                      ledger)
    assert len(ledger.history()) == 3


def test_a_release_beyond_max_epsilon_is_withheld(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path)
    ledger.save([(1.0, 0.1, 1000)])  # DP-SGD rounds already spent most of a budget of 2
    policy = PrivacyPolicy(label_histogram_epsilon=1.0, max_epsilon=2.0)
    assert epsilon([(1.0, 0.1, 1000)], 1e-5) > 1.0
    assert HistogramRelease(tmp_path).shared(EXACT, policy, "binary", ledger) is None
    assert ledger.history() == [(1.0, 0.1, 1000)]


def test_damaged_files(tmp_path: Path) -> None:
    ledger, policy = PrivacyLedger(tmp_path), PrivacyPolicy(label_histogram_epsilon=1.0)
    release = HistogramRelease(tmp_path)
    release.shared(EXACT, policy, "binary", ledger)
    (tmp_path / RELEASE_FILE).write_text(json.dumps({"histogram": {"0": -5}}))
    assert release.shared(EXACT, policy, "binary", ledger) is not None
    assert len(ledger.history()) == 2  # a damaged release is replaced, and charged again: never under-counted
    ledger.path.write_text("{not json")
    (tmp_path / RELEASE_FILE).unlink()
    assert release.shared(EXACT, policy, "binary", ledger) is None  # a damaged ledger: nothing leaves


def _agent(tmp_path: Path, policy: PrivacyPolicy, share: bool = True):  # noqa: ANN202
    from fedmqtt.data.spec import DataSpec
    from fedmqtt.transport.signing import FederationKeys
    from site_agent.agent import SiteAgent
    from site_agent.config import SiteConfig

    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 2))
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "h1.csv"
    path.write_text("a,b,y\n" + "".join(f"{a:.5f},{b:.5f},{int(a > 0)}\n" for a, b in x))
    data = DataSpec(format="table", path=path, options={"spec": {"label": "y", "task": "binary",
                                                                   "numeric": ["a", "b"]}})
    config = SiteConfig(site_id="h1", run_id="r", credentials=tmp_path / "none.toml", state_dir=tmp_path / "state",
                        data=data, device="cpu", privacy=policy, share_label_histogram=share)
    return SiteAgent(config, identity=FederationKeys("r", ["ps", "h1"]).identity("h1"))


def test_the_agents_status_carries_the_one_noised_release(tmp_path: Path) -> None:
    """The site's status (what recruitment reads) carries the noised counts, the same in every status and after a
    restart, and the ledger holds the one release; without the policy field the exact counts; without sharing
    nothing."""
    agent = _agent(tmp_path, PrivacyPolicy(label_histogram_epsilon=1.0))
    first = agent._status("online").label_histogram
    assert first is not None and agent._status("online").label_histogram == first
    assert len(agent.ledger.history()) == 1
    assert _agent(tmp_path, PrivacyPolicy(label_histogram_epsilon=1.0))._status("online").label_histogram == first
    assert len(agent.ledger.history()) == 1
    exact = _agent(tmp_path / "exact", PrivacyPolicy())
    assert exact._status("online").label_histogram == {"0": int((exact.data.y_train == 0).sum()),
                                                       "1": int((exact.data.y_train == 1).sum())}
    assert _agent(tmp_path / "none", PrivacyPolicy(label_histogram_epsilon=1.0), share=False)._status(
        "online").label_histogram is None

