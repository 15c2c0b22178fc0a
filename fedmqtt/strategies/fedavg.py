"""FedAvg (McMahan et al. 2017; docs/algorithms.md section 1): the sample-weighted mean of site models."""

from __future__ import annotations

from fedmqtt.strategies.aggregate import sample_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput
from fedmqtt.strategies.rule import ServerRule
from fedmqtt.strategies.strategy_doc import StrategyDoc


class FedAvg(ServerRule):
    """FedAvg (McMahan et al., AISTATS 2017): w_{t+1} = sum_{i in S_t} p_i w_i^t, p_i = n_i / n_S.

    Float buffers get the same p_i; integer buffers the maximum; everything is shared.
    """

    name = "fedavg"
    summary = "FedAvg: sample-weighted mean of the site models (McMahan et al. 2017)"
    needs_only_sums = True
    from_weighted_mean = True
    sums_note = (
        "sum n_i w_i and sum n_i (each site sends its weighted model and its weight); integer buffers take "
        "the maximum, which a sum cannot give: they travel next to the masked sum"
    )

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        return AggregateResult(weights=self.average(inp, sample_weights(inp.updates)))


ABOUT = StrategyDoc(
    section="1",
    title="FedAvg",
    names=("fedavg",),
    summary=(
        "Federated averaging: every participating site trains the global model on its own data, and the "
        "server replaces the global model by the average of the returned models, each site weighted by its "
        "number of training samples. Everything is shared, BatchNorm running statistics included. The "
        "baseline every other rule is compared with."
    ),
    server="""
w_{t+1} = sum_{i in S_t} p_i * w_i^t        p_i = n_i / n_S, renormalised over the sites that reported
float buffers (BN running_mean/var): the same p_i
integer buffers (BN num_batches_tracked): max over S_t
nobody reported: w_{t+1} = w_t
""",
    client="""
start from w_t; minimise the plain local loss F_i(w) for E epochs with the local optimiser
send w_i^t, n_i, tau_i
""",
    state="None beyond the global model; sites keep nothing between rounds.",
    papers=("McMahan, Moore, Ramage, Hampson, Aguera y Arcas: Communication-efficient learning of deep "
            "networks from decentralized data, AISTATS 2017 (arXiv 1602.05629).",),
    differences=(
        "BatchNorm's `num_batches_tracked` (an int64 counter) is the maximum over the participants, never "
        "averaged: frameworks that average every array (Flower's FedAvg among them) give a weighted mean of "
        "the counters instead. The two differ in that counter only, which matters only for BatchNorm layers "
        "with `momentum=None` (cumulative averages); weights and running statistics agree.",
        "Weights are renormalised over the sites that actually reported in time (a convex combination), "
        "never n_i / n over all enrolled sites.",
        "Sums run in ascending site-id order, so the result does not depend on the order updates arrive in.",
    ),
    example="""
Two sites, n = (1, 3), models [1, 2] and [3, 0]: w = 0.25*[1, 2] + 0.75*[3, 0] = [2.5, 0.5]; running_var
1.0 and 2.0 gives 1.75; num_batches_tracked 10 and 30 gives 30. With a third enrolled site (n = 4) that
did not report, the weights are still (0.25, 0.75). On the toy problem (0.7) the local results 0.19 and 0.95
give 0.57 with equal n and 0.76 with n = (1, 3).
""",
)
