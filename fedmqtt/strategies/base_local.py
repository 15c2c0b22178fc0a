"""Base (docs/algorithms.md section 13): local training only; nothing is shared, nothing aggregated."""

from __future__ import annotations

from fedmqtt.strategies.aggregate import copy_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, TensorSpec
from fedmqtt.strategies.rule import ServerRule
from fedmqtt.strategies.strategy_doc import StrategyDoc


class Base(ServerRule):
    """Base (the baseline of Chen et al.): every site trains alone; w_{t+1} = w_t, no tensor travels."""

    name = "base"
    summary = "Base: local training only, nothing is shared (the no-federation reference)"
    needs_only_sums = True
    sums_uniform = True  # the plain mean of no tensor: each site masks only its weight, and the PS learns the count
    sums_note = (
        "nothing is shared, so there is nothing to aggregate: under secure aggregation each site masks only its "
        "weight, and the PS learns how many sites trained, as in the clear"
    )

    def keeps_local(self, spec: TensorSpec) -> bool:
        return True

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        # Names absent from the manifest would otherwise count as shared; Base shares none at all.
        return AggregateResult(weights=copy_weights(inp.current))


ABOUT = StrategyDoc(
    section="13",
    title="Base (local training only)",
    names=("base",),
    summary=(
        "No federation: every site trains on its own data only, for the same number of rounds and epochs as "
        "the federated runs, and is evaluated on its own test split. The reference point that tells whether "
        "federating helps a site at all."
    ),
    server="""
w_{t+1} = w_t: no tensor travels in either direction; rounds only pace training, evaluation and selection
""",
    client="""
train its own model on the plain loss for E epochs per round; keep the whole model on disk
""",
    state="Sites: their whole model. Server: none.",
    papers=("Chen et al. and Milasheuski et al. use it as the no-federation "
            "baseline.",),
    differences=(
        "The best round is chosen like every other rule's, by the unweighted mean over sites of the "
        "validation metric (17.1), and the reported number is the unweighted mean of the sites' test "
        "metrics; Chen et al.'s code trains Base for 100 rounds of 3 local epochs, here the run's own settings "
        "apply.",
    ),
)
