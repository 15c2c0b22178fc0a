"""FedBN (Li et al. 2021; docs/algorithms.md section 3): normalization layers stay local, the rest is averaged."""

from __future__ import annotations

from pydantic import Field, field_validator

from fedmqtt.strategies.aggregate import participant_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, TensorSpec
from fedmqtt.strategies.params import ALL_NORMS, NormFamily, WeightingParams, expand_norm_types
from fedmqtt.strategies.rule import ServerRule, keeps_norm_local


class FedBNParams(WeightingParams):
    norm_types: tuple[NormFamily, ...] = Field(
        default=ALL_NORMS,
        description="normalization layers kept local: all (seed 000) or ['batchnorm'] (original FedBN)",
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
    params: FedBNParams

    def keeps_local(self, spec: TensorSpec) -> bool:
        return keeps_norm_local(spec, self.params.norm_types)

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        return AggregateResult(
            weights=self.average(inp, participant_weights(inp.updates, self.params.weighting))
        )
