"""The smallest path for rules that need only the sample-weighted mean of the updates (`from_weighted_mean`):
under secure aggregation the PS holds that mean (fedmqtt/secagg/weighted.py), never an update, and hands it to the
rule as the one update of the round, weighing the total sample count. The weighted mean of one update is that
update, so FedAvg, FedProx, FedPer, FedBN and (with sample weighting) FedAdam, FedAdagrad and FedYogi give what they
give on the sites' own updates, up to the ring's rounding: FedBN averages only the shared tensors, which are all
that is masked, and the FedOpt family's pseudo-gradient is the weighted mean minus the current model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from fedmqtt.strategies.base import AggregateResult, RoundInput, SiteUpdate, Strategy

SECURE_SUM = "secure-sum"  # the site id the mean travels under: the rule sees no site's own


def aggregate_from_mean(strategy: Strategy, inp: RoundInput, mean: Mapping[str, np.ndarray], n_samples: int,
                        ) -> AggregateResult:
    """The rule's aggregate of a round whose updates' weighted mean is `mean` (over `n_samples` samples).
    `inp.updates` is ignored. Raises ValueError for a rule whose server step needs more than that mean."""
    if refusal := weighted_mean_refusal(strategy):
        raise ValueError(refusal)
    one = SiteUpdate(site_id=SECURE_SUM, tensors=dict(mean), n_samples=max(int(n_samples), 1), local_steps=0)
    return strategy.aggregate_train(replace(inp, updates=[one]))


def weighted_mean_refusal(strategy: object) -> str | None:
    """Why `strategy` (configured) cannot aggregate from the weighted mean alone; None when it can."""
    check = getattr(strategy, "weighted_mean_refusal", None)
    if check is None:
        return f"{getattr(strategy, 'name', strategy)} does not aggregate from the weighted mean of the updates alone"
    refusal = check()
    return refusal if isinstance(refusal, str) else None
