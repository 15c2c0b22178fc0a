"""Base (docs/algorithms.md section 13): local training only; nothing is shared, nothing aggregated."""

from __future__ import annotations

from fedmqtt.strategies.aggregate import copy_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, TensorSpec
from fedmqtt.strategies.rule import ServerRule


class Base(ServerRule):
    """Base (seed 001 baseline): every site trains alone; w_{t+1} = w_t, no tensor travels."""

    name = "base"
    summary = "Base: local training only, nothing is shared (the no-federation reference)"

    def keeps_local(self, spec: TensorSpec) -> bool:
        return True

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        # Names absent from the manifest would otherwise count as shared; Base shares none at all.
        return AggregateResult(weights=copy_weights(inp.current))
