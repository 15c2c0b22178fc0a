"""FedAvg (McMahan et al. 2017; docs/algorithms.md section 1): the sample-weighted mean of site models."""

from __future__ import annotations

from fedmqtt.strategies.aggregate import sample_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput
from fedmqtt.strategies.rule import ServerRule


class FedAvg(ServerRule):
    """FedAvg (McMahan et al., AISTATS 2017): w_{t+1} = sum_{i in S_t} p_i w_i^t, p_i = n_i / n_S.

    Float buffers get the same p_i; integer buffers the maximum; everything is shared.
    """

    name = "fedavg"
    summary = "FedAvg: sample-weighted mean of the site models (McMahan et al. 2017)"

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        return AggregateResult(weights=self.average(inp, sample_weights(inp.updates)))
