"""FedBN (Li et al. 2021; docs/algorithms.md section 3): normalization layers local, the rest averaged."""

from __future__ import annotations

from pydantic import Field, field_validator

from fedmqtt.strategies.aggregate import participant_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, TensorSpec
from fedmqtt.strategies.params import ALL_NORMS, NormFamily, WeightingParams, expand_norm_types
from fedmqtt.strategies.rule import ServerRule, keeps_norm_local
from fedmqtt.strategies.strategy_doc import StrategyDoc


class FedBNParams(WeightingParams):
    norm_types: tuple[NormFamily, ...] = Field(
        default=ALL_NORMS,
        description="normalization layers kept local: all (Hwang et al.) or ['batchnorm'] (original FedBN)",
    )
    _expand = field_validator("norm_types", mode="before")(expand_norm_types)


class FedBN(ServerRule):
    """FedBN (Li et al., ICLR 2021): w_{t+1} = sum_i p_i w_i^t over non-NORM tensors; NORM stays local.

    NORM means every parameter and buffer of a normalization layer of the configured `norm_types`
    (docs/algorithms.md 3 DECISION: all types by default; `weighting = uniform` gives the original 1/N).
    """

    name = "fedbn"
    summary = (
        "FedBN: normalization layers (affine + statistics) stay local, the rest is averaged (Li et al. 2021)"
    )
    Params = FedBNParams
    needs_only_sums = True
    from_weighted_mean = True
    sums_note = (
        "the weighted sum of the shared (non-normalization) tensors, the only ones masked; the normalization "
        "layers stay on the sites (weighting = \"samples\" under secure aggregation; \"uniform\" is refused there)"
    )
    params: FedBNParams

    def keeps_local(self, spec: TensorSpec) -> bool:
        return keeps_norm_local(spec, self.params.norm_types)

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        return AggregateResult(
            weights=self.average(inp, participant_weights(inp.updates, self.params.weighting))
        )


ABOUT = StrategyDoc(
    section="3",
    title="FedBN",
    names=("fedbn",),
    summary=(
        "Normalization layers stay on the sites: their affine parameters and running statistics are never "
        "sent and never averaged, so each site keeps statistics that fit its own data (scanner, population, "
        "protocol). Every other tensor is averaged as in FedAvg. There is no single global model after round "
        "1: each site is evaluated with its composed model (global shared tensors + its own normalization)."
    ),
    server="""
shared = every tensor not owned by a normalization layer of norm_types
w_{t+1}[shared] = sum_{i in S_t} p_i * w_i^t[shared]     (weighting = uniform: 1/|S_t|)
normalization tensors: not received, not changed (round 1 sends the full initial model)
""",
    client="""
load the shared tensors from the task and the normalization tensors from the site's own store;
train the whole model on the plain loss; store the new normalization tensors; upload the shared ones
""",
    state="Sites: their normalization tensors (affine parameters and buffers), on disk. Server: none.",
    papers=("Li, Jiang, Zhang, Kamp, Dou: FedBN: federated learning on non-IID features via local batch "
            "normalization, ICLR 2021 (arXiv 2102.07623).",
            "Hwang et al.: keeps every normalization type local (BatchNorm, GroupNorm, "
            "LayerNorm).",),
    differences=(
        "Normalization layers are found by module type (tags in the site's tensor manifest), never by "
        "substrings such as `bn` in parameter names, which miss layers named otherwise.",
        "By default every normalization type stays local (Hwang et al.); the original FedBN keeps only "
        "BatchNorm: `norm_types = [\"batchnorm\"]` reproduces it.",
        "Sample weights p_i by default; the original code averages with 1/N (equal-sized clients): "
        "`weighting = \"uniform\"` reproduces it.",
    ),
    example="""
Shared fc.weight [1, 2] and [3, 0] with n = (1, 3) becomes [2.5, 0.5]; bn.weight 1.2 / 0.8 and
bn.running_mean 0.1 / -0.3 stay where they are. Toy with a shared u and a local scale g (targets a = (1, 5),
b = (2, 0), start u = 0, g = 1): u = 0.19 and 0.95 average to 0.57; g = 1.19 and 0.81 stay on the sites.
""",
)
