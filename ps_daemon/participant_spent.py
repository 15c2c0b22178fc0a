"""What participant-level DP has cost the run's released models so far, read back from the closed rounds' records.

A DP server rule (DP-FedAvg) writes into each round's diagnostics ("server") the epsilon at its delta after that
round, the releases its accountant has charged and `epsilon_<accountant>` naming whose bound it is
(fedmqtt/strategies/dp_fedavg.py). The records are checkpointed, so a resumed PS says the same in ps/status as
before it stopped. Pure: the PS state machine calls it to build its status.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

from pydantic import ValidationError

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


def _whole(x: float) -> int:
    if x != int(x):
        raise ValueError(f"a count of releases is whole, not {x!r}")
    return int(x)
