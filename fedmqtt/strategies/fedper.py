"""FedPer (Arivazhagan et al. 2019; docs/algorithms.md 12): HEAD layers stay local, the base is averaged."""

from __future__ import annotations

from fedmqtt.strategies.aggregate import sample_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, TensorSpec
from fedmqtt.strategies.rule import ServerRule


class FedPer(ServerRule):
    """FedPer (Arivazhagan et al., arXiv 1912.00818): base tensors w_{t+1} = sum_i p_i w_i^t; HEAD local.

    Which layers are HEAD is decided by the site's model registry (`tensor_manifest(head=...)`,
    default: the output layer); buffers follow the module that owns them.
    """

    name = "fedper"
    summary = "FedPer: personal HEAD layers stay local; base layers are averaged (Arivazhagan et al. 2019)"

    def keeps_local(self, spec: TensorSpec) -> bool:
        return spec.is_head

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        return AggregateResult(weights=self.average(inp, sample_weights(inp.updates)))
