"""What participant-level DP has cost the run's released models so far, read back from the closed rounds' records.

A DP server rule (DP-FedAvg) writes into each round's diagnostics ("server") the epsilon at its delta after that
round, the releases its accountant has charged and `epsilon_<accountant>` naming whose bound it is
(fedmqtt/strategies/dp_fedavg.py). The records are checkpointed, so a resumed PS says the same in ps/status as
before it stopped. Pure: the PS state machine calls `spent_in_run` to build its status, and the Prometheus endpoint
(ps_daemon/monitoring.py) calls the same function for its epsilon gauge, so the two never say different things.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

from pydantic import ValidationError

from fedmqtt.strategies.dp_fedavg import DPFedAvg
from ps_daemon.config import DaemonConfig
from ps_daemon.state import RoundRecord
from schemas import messages as m

ACCOUNTANTS: tuple[m.ParticipantAccountant, ...] = get_args(m.ParticipantAccountant)


def spent_after(record: RoundRecord) -> m.ParticipantSpent | None:
    """The spending after this round; None when its rule released the model without participant-level DP, its
    release was not charged (no update), or the record predates the accountant's name in it."""
    server = record.server
    if "epsilon" not in server:
        return None
    named = [a for a in ACCOUNTANTS if f"epsilon_{a}" in server]
    if len(named) != 1 or "epsilon_rounds" not in server or "delta" not in server:
        return None
    try:
        return m.ParticipantSpent(epsilon=server["epsilon"], delta=server["delta"], accountant=named[0],
                                  rounds=_whole(server["epsilon_rounds"]), round=record.round)
    except (ValidationError, ValueError, TypeError, OverflowError):  # out of the wire's range: not shown
        return None


def spent_so_far(history: Sequence[RoundRecord]) -> m.ParticipantSpent | None:
    """The newest closed round's spending (a round that released nothing leaves the previous one standing)."""
    for record in reversed(history):
        if (spent := spent_after(record)) is not None:
            return spent
    return None


def spent_in_run(config: DaemonConfig, history: Sequence[RoundRecord]) -> m.ParticipantSpent | None:
    """What participant-level DP has cost this run so far, as ps/status (DaemonStatus.participant_dp) and the
    Prometheus gauge both report it. Only a DP server rule writes its spending into its records: other runs skip
    the look through the history (a run may have 100 000 rounds)."""
    return spent_so_far(history) if config.algorithm == DPFedAvg.name else None


def _whole(x: float) -> int:
    if x != int(x):
        raise ValueError(f"a count of releases is whole, not {x!r}")
    return int(x)
