"""A site's privacy policy (site_agent.policy): each rule refuses what breaks it, with the reason, and accepts
what does not; the privacy ledger (site_agent.privacy_ledger) survives a restart and refuses a damaged file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.messages import ModelSpec, RecordDP, TrainSettings, TrainTask
from schemas.secagg import SecAggTerms
from site_agent.policy import REFUSED, PrivacyPolicy, epsilon_refusal, task_refusal
from site_agent.privacy_ledger import MAX_LEDGER_BYTES, LedgerError, PrivacyLedger

MLP = ModelSpec(name="mlp", args={"in_features": 13})
DP = RecordDP(max_grad_norm=1.0, noise_multiplier=1.0, delta=1e-5)


def _task(round_no: int = 1, **settings: object) -> TrainTask:
    return TrainTask(run_id="r", sender="ps", round=round_no, site_id="a", model_hash="h", deadline=0.0,
                     settings=TrainSettings(**settings))  # type: ignore[arg-type]


def _refusal(policy: PrivacyPolicy, task: TrainTask | None = None, model: ModelSpec = MLP, n: int = 100) -> str | None:
    return task_refusal(policy, task or _task(), model, n)


def test_the_default_policy_accepts_any_task() -> None:
    assert _refusal(PrivacyPolicy()) is None
    assert _refusal(PrivacyPolicy(), _task(round_no=10_000, epochs=500, algorithm="scaffold")) is None


def test_algorithms_rule() -> None:
    policy = PrivacyPolicy(algorithms=("fedavg", "fedprox"))
    assert _refusal(policy, _task(algorithm="fedprox")) is None
    why = _refusal(policy, _task(algorithm="scaffold"))
    assert why is not None and why.startswith(REFUSED) and "'scaffold'" in why and "fedavg, fedprox" in why


def test_models_rule() -> None:
    policy = PrivacyPolicy(models=("lenet5",))
    why = _refusal(policy)
    assert why is not None and "model 'mlp'" in why
    assert _refusal(policy, model=ModelSpec(name="lenet5")) is None


def test_max_rounds_rule() -> None:
    policy = PrivacyPolicy(max_rounds=3)
    assert _refusal(policy, _task(round_no=3)) is None
    why = _refusal(policy, _task(round_no=4))
    assert why is not None and "round 4" in why and "max_rounds 3" in why


def test_max_epochs_rule() -> None:
    policy = PrivacyPolicy(max_epochs=2)
    assert _refusal(policy, _task(epochs=2)) is None
    why = _refusal(policy, _task(epochs=3))
    assert why is not None and "max_epochs 2" in why


def test_min_records_rule() -> None:
    policy = PrivacyPolicy(min_records_per_update=50)
    assert _refusal(policy, n=50) is None
    why = _refusal(policy, n=49)
    assert why is not None and "49 training records" in why


def test_require_record_dp_rule() -> None:
    policy = PrivacyPolicy(require_record_dp=True)
    why = _refusal(policy)
    assert why is not None and "without record-level DP" in why and "require_record_dp" in why
    assert _refusal(policy, _task(dp=DP)) is None


def test_require_secure_aggregation_rule() -> None:
    """A site that requires secure aggregation refuses a task in the clear, with the reason, and accepts one that
    carries the ring's terms."""
    policy = PrivacyPolicy(require_secure_aggregation=True)
    why = _refusal(policy)
    assert why is not None and why.startswith(REFUSED) and "without secure aggregation" in why
    assert "require_secure_aggregation" in why
    terms = SecAggTerms(ring_bits=32, fraction_bits=16, clip=8.0, max_sites=4, dropout=0.1)
    assert _refusal(policy, _task().model_copy(update={"secure_aggregation": terms})) is None
    assert _refusal(PrivacyPolicy()) is None  # off by default


def test_a_budget_also_refuses_a_task_without_dp() -> None:
    why = _refusal(PrivacyPolicy(max_epsilon=3.0))
    assert why is not None and "max_epsilon 3" in why and "unbounded" in why


def test_max_delta_rule() -> None:
    policy = PrivacyPolicy(max_delta=1e-6)
    why = _refusal(policy, _task(dp=DP))
    assert why is not None and "delta 1e-05" in why
    assert _refusal(policy, _task(dp=DP.model_copy(update={"delta": 1e-7}))) is None


def test_epsilon_rule_refuses_the_round_that_would_exceed_the_budget() -> None:
    policy = PrivacyPolicy(max_epsilon=3.0)
    assert epsilon_refusal(policy, 2, 1.0, 3.0, 1e-5) is None  # exactly at the budget: allowed
    why = epsilon_refusal(policy, 4, 2.5, 3.2, 1e-5)
    assert why is not None and why.startswith(REFUSED)
    assert "round 4" in why and "3.2" in why and "2.5" in why and "max_epsilon 3" in why
    assert epsilon_refusal(PrivacyPolicy(), 4, 100.0, 1e9, 1e-5) is None


def test_policy_fields_are_validated() -> None:
    from pydantic import ValidationError

    for bad in ({"max_epsilon": 0}, {"max_epsilon": float("inf")}, {"max_delta": 1.0}, {"max_rounds": 0},
                {"min_records_per_update": -1}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            PrivacyPolicy.model_validate(bad)


# -- the ledger ---------------------------------------------------------------------------------------------
def test_ledger_survives_a_restart(tmp_path: Path) -> None:
    history = [(1.0, 0.1, 30), (0.8, 0.05, 12)]
    PrivacyLedger(tmp_path).save(history)
    assert PrivacyLedger(tmp_path).history() == history  # a new instance: what a restarted agent builds
    assert PrivacyLedger(tmp_path / "never").history() == []


@pytest.mark.parametrize("content", [
    b"not json",
    b"[]",
    b'{"version": 2, "history": []}',
    b'{"version": 1, "history": [[1.0, 0.1]]}',
    b'{"version": 1, "history": [[-1.0, 0.1, 3]]}',
    b'{"version": 1, "history": [[1.0, 0.0, 3]]}',
    b'{"version": 1, "history": [[1.0, 1.5, 3]]}',
    b'{"version": 1, "history": [[1.0, 0.1, 0]]}',
    b'{"version": 1, "history": [[1.0, 0.1, true]]}',
    b'{"version": 1, "history": [[1.0, 0.1, "3"]]}',
    b'{"version": 1, "history": [[NaN, 0.1, 3]]}',
    b'{"version": 1, "history": [[1.0, 0.1, 3]], "extra": 1}',
    b'{"version": 1, "history": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
])
def test_a_damaged_ledger_is_refused_not_reset(tmp_path: Path, content: bytes) -> None:
    ledger = PrivacyLedger(tmp_path)
    ledger.path.write_bytes(content)
    with pytest.raises(LedgerError, match="damaged.*under-count"):
        ledger.history()


def test_an_oversized_ledger_is_refused_before_it_is_read(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path)
    ledger.path.write_bytes(b" " * (MAX_LEDGER_BYTES + 1))
    with pytest.raises(LedgerError, match="bytes"):
        ledger.history()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20))
def test_any_json_either_loads_as_a_valid_history_or_is_refused(tmp_path: Path, value: object) -> None:
    ledger = PrivacyLedger(tmp_path)
    ledger.path.write_text(json.dumps({"version": 1, "history": value}))
    try:
        history = ledger.history()
    except LedgerError:
        return
    assert all(s >= 0 and 0 < q <= 1 and n >= 1 for s, q, n in history)
