"""Before round 1 the PS checks its run against every online site's privacy policy (ps_daemon.policy_quorum) and
does not start a run that fewer than `quorum` sites would accept, naming them and the rule each would break."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedmqtt.strategies import FedAvg
from ps_daemon import effects as fx
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SiteOnline
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights
from ps_daemon.policy_quorum import quorum_refusal, refusing_sites, run_breaches
from schemas.base import MAX_DETAIL
from schemas.messages import DaemonStatus, PrivacyPolicy, SiteStatus

SITES = ("site-a", "site-b", "site-c")
DP = {"max_grad_norm": 1.0, "target_epsilon": 4.0, "delta": 1e-5}


def _config(**overrides: Any) -> DaemonConfig:
    raw = {"run_id": "r1", "sites": list(SITES), "rounds": 5, "quorum": 2, "model": {"name": "mlp", "args": {}},
           "credentials": "creds.toml", **overrides}
    return DaemonConfig.model_validate(raw)


# -- each rule, judged on the run's config -------------------------------------------------------------------
@pytest.mark.parametrize("policy, overrides, rule", [
    (PrivacyPolicy(algorithms=("fedprox",)), {}, "algorithms: the run's 'fedavg' is not listed (fedprox)"),
    (PrivacyPolicy(models=("lenet5",)), {}, "models: the run's 'mlp' is not listed (lenet5)"),
    (PrivacyPolicy(max_rounds=3), {}, "max_rounds 3: the run has 5 rounds"),
    (PrivacyPolicy(max_epochs=1), {"train": {"epochs": 2}}, "max_epochs 1: the run trains 2 local epochs"),
    (PrivacyPolicy(min_records_per_update=200), {}, "min_records_per_update 200: the site has 100 training"),
    (PrivacyPolicy(require_record_dp=True), {}, "require_record_dp: the run has no record-level DP"),
    (PrivacyPolicy(max_epsilon=8), {}, "max_epsilon 8: the run has no record-level DP"),
    (PrivacyPolicy(max_epsilon=2), {"train": {"dp": DP}}, "max_epsilon 2: the run plans to spend epsilon 4"),
    (PrivacyPolicy(max_delta=1e-6), {"train": {"dp": DP}}, "max_delta 1e-06: the run's delta is 1e-05"),
])
def test_each_rule_names_what_the_run_breaks(policy: PrivacyPolicy, overrides: dict[str, Any], rule: str) -> None:
    broken = run_breaches(_config(**overrides), policy, n_train=100)
    assert len(broken) == 1 and broken[0].startswith(rule), broken


def test_a_run_within_every_rule_is_accepted() -> None:
    policy = PrivacyPolicy(max_epsilon=4, max_delta=1e-5, require_record_dp=True, min_records_per_update=100,
                           algorithms=("fedavg",), models=("mlp",), max_rounds=5, max_epochs=1)
    assert run_breaches(_config(train={"dp": DP}), policy, n_train=100) == ()
    assert run_breaches(_config(), PrivacyPolicy(), n_train=0) == ()


def test_every_broken_rule_is_named() -> None:
    policy = PrivacyPolicy(require_record_dp=True, max_rounds=1, models=("lenet5",))
    assert [b.split(":")[0] for b in run_breaches(_config(), policy, 100)] == ["models", "max_rounds 1",
                                                                               "require_record_dp"]


def test_noise_multiplier_runs_are_left_to_the_sites_accountant() -> None:
    """Without a target epsilon the PS cannot know what the run spends (the accountant runs at the site)."""
    dp = {"max_grad_norm": 1.0, "noise_multiplier": 0.1}
    assert run_breaches(_config(train={"dp": dp}), PrivacyPolicy(max_epsilon=0.1), 100) == ()


def test_a_site_without_a_published_policy_accepts() -> None:
    config = _config()
    policies = {"site-a": PrivacyPolicy(require_record_dp=True), "site-b": None}
    refusers = refusing_sites(config, policies, {"site-a": 10, "site-b": 10}, ["site-a", "site-b", "site-c"])
    assert list(refusers) == ["site-a"]
    assert quorum_refusal(config, refusers, ["site-a", "site-b", "site-c"]) is None  # b and c: quorum 2


@given(st.integers(0, 3), st.integers(1, 3))
def test_quorum_refusal_exactly_when_too_few_accept(n_refusing: int, quorum: int) -> None:
    config = _config(quorum=quorum)
    refusers = {s: ("require_record_dp: no DP",) for s in SITES[:n_refusing]}
    why = quorum_refusal(config, refusers, SITES)
    assert (why is not None) == (len(SITES) - n_refusing < quorum)
    if why is not None:
        assert all(s in why for s in refusers) and f"quorum {quorum}" in why


def test_the_reason_fits_a_status_however_long_the_policies() -> None:
    many = tuple(f"algo{i}" for i in range(256))
    refusers = {f"s{i}": (f"algorithms: {'x' * 64}",) * 9 for i in range(40)}
    why = quorum_refusal(_config(quorum=1), refusers, list(refusers))
    assert why is not None and len(why) <= MAX_DETAIL and "s0 (algorithms" in why and "restart them" in why
    assert "and 2 more" in quorum_refusal(_config(quorum=1), {f"s{i}": ("max_rounds 1",) for i in range(10)},
                                          [f"s{i}" for i in range(10)]) or ""
    assert "and 248 more" in run_breaches(_config(), PrivacyPolicy(algorithms=many), 1)[0]


# -- the machine: waits, says who refuses and why; starts once enough accept ---------------------------------
def _machine(**overrides: Any) -> Machine:
    return Machine(_config(**overrides), FedAvg(), hash_weights)


def _online(site: str, policy: PrivacyPolicy | None) -> SiteOnline:
    return SiteOnline(site, now=1.0, n_train=50, policy=policy)


def test_machine_waits_while_no_quorum_accepts_and_names_the_refusing_sites() -> None:
    machine = _machine(quorum=2)
    state = machine.initial_state({"w": np.zeros(2, np.float32)})
    strict = PrivacyPolicy(require_record_dp=True)
    for site, policy in (("site-a", strict), ("site-b", strict), ("site-c", None)):
        state, effects = machine.step(state, _online(site, policy))
    assert state.phase == "waiting_for_sites"
    status = [e for e in effects if isinstance(e, fx.PublishStatus)][-1]
    warning = [e for e in effects if isinstance(e, fx.Log)][0]
    for text in (status.detail, warning.text):
        assert "site-a (require_record_dp: the run has no record-level DP" in text
        assert "site-b (require_record_dp" in text and "fewer than quorum 2" in text
        assert "site-c" not in text.split("Refusing:")[1]
    # site-b restarts with a policy this run meets: two sites accept, round 1 starts
    state, effects = machine.step(state, _online("site-b", PrivacyPolicy(max_rounds=10)))
    assert state.phase == "training" and state.round == 1
    logs = [e.text for e in effects if isinstance(e, fx.Log)]
    assert any("some sites refuse this run" in m and "site-a (require_record_dp" in m for m in logs)


def test_status_messages_carry_the_policy_and_the_reason_validates() -> None:
    """The policy travels in the site's (signed, validated) status; the PS's reason fits its status schema."""
    policy = PrivacyPolicy(max_epsilon=3.0, algorithms=("fedavg",))
    status = SiteStatus(run_id="r1", sender="site-a", round=0, state="online", privacy_policy=policy)
    again = SiteStatus.model_validate_json(status.model_dump_json())
    assert again.privacy_policy == policy
    with pytest.raises(ValueError):
        SiteStatus.model_validate({**status.model_dump(), "privacy_policy": {"max_epsilon": -1}})
    with pytest.raises(ValueError):
        SiteStatus.model_validate({**status.model_dump(), "privacy_policy": {"surprise": 1}})
    why = quorum_refusal(_config(quorum=3), {"site-a": ("max_rounds 1: the run has 5 rounds",)}, SITES)
    assert why is not None
    DaemonStatus(run_id="r1", sender="ps", round=0, state="waiting_for_sites", detail=why)


def test_with_recruitment_the_warning_about_refusing_sites_is_kept_beside_recruitments_verdicts() -> None:
    hist = (30, 30, 20, 10)
    machine = Machine(_config(selection="recruited", recruitment={"gamma_th": 1.0}, quorum=1), FedAvg(), hash_weights)
    state = machine.initial_state({"w": np.zeros(2, np.float32)})
    for site in SITES:
        policy = PrivacyPolicy(max_epochs=1, require_record_dp=site == "site-c")
        state, effects = machine.step(state, SiteOnline(site, 0.0, 50, hist, policy))
    assert state.phase == "training"
    assert any(isinstance(e, fx.PublishRecruitment) for e in effects)
    warnings = [e.text for e in effects if isinstance(e, fx.Log) and "refuse this run" in e.text]
    assert len(warnings) == 1 and "site-c (require_record_dp" in warnings[0] and "site-a" not in warnings[0]


def test_a_site_that_requires_secure_aggregation_refuses_a_run_in_the_clear() -> None:
    from ps_daemon.policy_quorum import run_breaches
    from schemas.messages import PrivacyPolicy

    policy = PrivacyPolicy(require_secure_aggregation=True)
    clear = _config()
    secure = _config(secure_aggregation={"enabled": True})
    assert any("require_secure_aggregation" in why for why in run_breaches(clear, policy, 100))
    assert not any("require_secure_aggregation" in why for why in run_breaches(secure, policy, 100))
