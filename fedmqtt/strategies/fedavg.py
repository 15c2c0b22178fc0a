"""FedAvg (McMahan et al. 2017; algorithms.md section 1): the sample-weighted mean of site models."""

from __future__ import annotations

from typing import Any

from fedmqtt.strategies.aggregate import sample_weights, weighted_mean
from fedmqtt.strategies.base import SiteUpdate, Weights


class FedAvg:
    """w_{t+1} = sum_i p_i w_i^t with p_i = n_i / n_S; BN float buffers alike, integer buffers max."""

    name = "fedavg"

    def aggregate_train(self, round_no: int, current: Weights, updates: list[SiteUpdate]) -> Weights:
        return weighted_mean(updates, sample_weights(updates), current)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state  # FedAvg keeps no server state beyond the global model
