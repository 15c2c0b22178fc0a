"""The Strategy protocol: pure numpy server rules, no I/O, no clock, no global random."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np

Weights = dict[str, np.ndarray]


@dataclass(frozen=True)
class SiteUpdate:
    """One site's contribution to a round, as the strategy sees it (numpy only)."""

    site_id: str
    tensors: Mapping[str, np.ndarray]
    n_samples: int
    local_steps: int
    extras: Mapping[str, Any] = field(default_factory=dict)


class Strategy(Protocol):
    """A server rule. `aggregate_train` must treat `updates` in the order given (sorted by site id)."""

    name: str

    def aggregate_train(self, round_no: int, current: Weights, updates: list[SiteUpdate]) -> Weights: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
