"""FedPer (Arivazhagan et al. 2019; docs/algorithms.md 12): HEAD layers stay local, the base is averaged."""

from __future__ import annotations

from fedmqtt.strategies.aggregate import sample_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, TensorSpec
from fedmqtt.strategies.rule import ServerRule
from fedmqtt.strategies.strategy_doc import StrategyDoc


class FedPer(ServerRule):
    """FedPer (Arivazhagan et al., arXiv 1912.00818): base tensors w_{t+1} = sum_i p_i w_i^t; HEAD local.

    Which layers are HEAD is decided by the site's model registry (`tensor_manifest(head=...)`,
    default: the output layer); buffers follow the module that owns them.
    """

    name = "fedper"
    summary = "FedPer: personal HEAD layers stay local; base layers are averaged (Arivazhagan et al. 2019)"
    needs_only_sums = True
    from_weighted_mean = True
    sums_note = (
        "the weighted sum of the base layers; the personal head stays on the sites"
    )

    def keeps_local(self, spec: TensorSpec) -> bool:
        return spec.is_head

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        return AggregateResult(weights=self.average(inp, sample_weights(inp.updates)))


ABOUT = StrategyDoc(
    section="12",
    title="FedPer",
    names=("fedper",),
    summary=(
        "Personalisation layers: the top of the network (by default the output layer) stays on each site, "
        "the base layers are averaged as in FedAvg. Each site ends with a shared feature extractor and its "
        "own head."
    ),
    server="""
w_{t+1}[base] = sum_{i in S_t} p_i * w_i^t[base]          HEAD tensors: never received, never changed
""",
    client="""
load the base tensors, keep its own head; train base and head together on the plain loss;
upload the base tensors, store the head on disk
""",
    state="Sites: their head (personal layers). Server: none.",
    papers=("Arivazhagan, Aggarwal, Singh, Choudhary: Federated learning with personalization layers, "
            "arXiv 1912.00818 (2019).",),
    differences=(
        "Which layers are personal is decided by the site's model registry (HEAD tags in the tensor "
        "manifest), default the final classification layer; buffers follow the module that owns them. The "
        "paper tried several depths of personal layers.",
        "Absent sites keep a stale head; a new site has to train a head: there is no global model.",
    ),
    example="""
base.weight [1, 2] and [3, 0] with n = (1, 3) becomes [2.5, 0.5] at both sites; heads 0.7 and -0.2 stay put.
""",
)
