"""The PS under record-level DP (ps_daemon/admission.py): an update must say what it spent, at the run's delta and
with the run's accountant; without DP it must not claim any. Refusals counted under "privacy"."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedmqtt.strategies import build_strategy
from ps_daemon.admission import update_rejection
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SiteOnline
from ps_daemon.machine import Machine
from ps_daemon.refusals import refusal_category
from ps_daemon.runner import hash_weights
from schemas import messages as m
from schemas.tensors import arrays_to_blobs

WEIGHTS = {"fc.weight": np.zeros((2, 3), np.float32), "fc.bias": np.zeros(2, np.float32)}
DP = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "delta": 1e-5}
SPENT = m.PrivacySpent(epsilon=0.8, delta=1e-5, noise_multiplier=1.0, sample_rate=0.1, steps=10)


def _machine(dp: dict[str, Any] | None) -> tuple[Machine, Any]:
    config = DaemonConfig.model_validate({"run_id": "r1", "sites": ["site-a"], "model": {"name": "mlp"},
                                          "credentials": "c.toml", "rounds": 2,
                                          "train": {"dp": dp} if dp else {}})
    machine = Machine(config, build_strategy("fedavg"), hash_weights)
    state = machine.initial_state(dict(WEIGHTS), session="5e55")
    state, _ = machine.step(state, SiteOnline("site-a", now=0.0, n_train=10))
    return machine, state


def _update(state: Any, **changes: Any) -> m.ClientUpdate:
    fields = dict(run_id="r1", sender="site-a", round=1, session=state.session, base_model_hash=state.model_hash,
                  tensors=arrays_to_blobs(WEIGHTS), n_samples=10, local_steps=2)
    return m.ClientUpdate(**{**fields, **changes})


@pytest.mark.parametrize(("dp", "privacy", "why"), [
    (DP, None, "does not say what it spent"),
    (DP, SPENT.model_copy(update={"delta": 1e-3}), "not the run's 1e-05 (rdp)"),
    (DP, SPENT.model_copy(update={"accountant": "prv"}), "not the run's 1e-05 (rdp)"),
    (None, SPENT, "trains without DP"),
])
def test_an_update_that_misstates_its_privacy_is_refused(dp: dict[str, Any] | None, privacy: m.PrivacySpent | None,
                                                         why: str) -> None:
    machine, state = _machine(dp)
    reason = update_rejection(machine, state, "site-a", _update(state, privacy=privacy))
    assert reason is not None and why in reason
    assert refusal_category(reason) == "privacy"


def test_an_update_that_states_its_privacy_is_taken() -> None:
    machine, state = _machine(DP)
    assert update_rejection(machine, state, "site-a", _update(state, privacy=SPENT)) is None
    plain, plain_state = _machine(None)
    assert update_rejection(plain, plain_state, "site-a", _update(plain_state)) is None


def test_a_refusal_answer_needs_no_privacy() -> None:
    """A site that refused the round (its policy) trained nothing and spent nothing."""
    machine, state = _machine(DP)
    answer = _update(state, tensors=(), local_steps=0, n_samples=0, no_step_reason="refused by this site's policy")
    assert update_rejection(machine, state, "site-a", answer) is None
