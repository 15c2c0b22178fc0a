"""The smallest path for rules that need only the sample-weighted mean of the updates (`from_weighted_mean`):
under secure aggregation the PS holds that mean (fedmqtt/secagg/weighted.py), never an update, and hands it to the
rule as the one update of the round, weighing the total sample count. The weighted mean of one update is that
update, so FedAvg, FedProx, FedPer, FedBN and (with sample weighting) FedAdam, FedAdagrad and FedYogi give what they
give on the sites' own updates, up to the ring's rounding: FedBN averages only the shared tensors, which are all
that is masked, and the FedOpt family's pseudo-gradient is the weighted mean minus the current model."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from fedmqtt.strategies.base import AggregateResult, RoundInput, SiteUpdate, Strategy

SECURE_SUM = "secure-sum"  # the site id the mean travels under: the rule sees no site's own


def aggregate_from_mean(strategy: Strategy, inp: RoundInput, mean: Mapping[str, np.ndarray], n_samples: int,
                        variates: Mapping[str, np.ndarray] | None = None, included: Iterable[str] = (),
                        ) -> AggregateResult:
    """The rule's aggregate of a round whose updates' weighted mean is `mean` (over `n_samples` samples).
    `inp.updates` is ignored. Raises ValueError for a rule whose server step needs more than that mean.

    A rule that sums control-variate deltas (`sums_variates`, SCAFFOLD) also needs `variates`, sum_i n_i Delta_c_i
    over the sites in the sum, and `included`, those sites: the one update carries Delta_c = variates / n_samples,
    and the enrolled counts stand it in for the included sites, so that its population weight n_samples / n times
    that Delta_c is sum_i n_i Delta_c_i / n, the rule's own sum_i pi_i Delta_c_i."""
    if refusal := weighted_mean_refusal(strategy):
        raise ValueError(refusal)
    n = max(int(n_samples), 1)
    extras: dict[str, object] = {}
    enrolled = dict(inp.enrolled)
    if getattr(strategy, "sums_variates", False):
        if variates is None:
            raise ValueError(f"{strategy.name} needs the sum of the control-variate deltas next to the mean")
        extras["delta_c"] = {name: np.asarray(v, dtype=np.float64) / n for name, v in variates.items()}
        gone = set(included)
        enrolled = {s: c for s, c in enrolled.items() if s not in gone} | {SECURE_SUM: n}
    one = SiteUpdate(site_id=SECURE_SUM, tensors=dict(mean), n_samples=n, local_steps=0, extras=extras)
    return strategy.aggregate_train(replace(inp, updates=[one], enrolled=enrolled))


def aggregate_from_uniform_mean(strategy: Strategy, inp: RoundInput, mean: Mapping[str, np.ndarray],
                                count: int) -> AggregateResult:
    """The aggregate of a rule that steps from the plain (unweighted) mean of the updates (`sums_uniform`: FedFBN,
    FedDyn), `count` sites in it: the rule's own `aggregate_from_uniform_mean` when it has one (FedDyn's drift
    needs the count), else the rule on the mean as the round's one update (the plain mean of one update is that
    update). Raises ValueError for another rule, or one whose parameters need more than the plain mean."""
    if not getattr(strategy, "sums_uniform", False):
        raise ValueError(f"{strategy.name} does not aggregate from the plain mean of the updates")
    if refusal := mean_refusal(strategy):
        raise ValueError(refusal)
    step = getattr(strategy, "aggregate_from_uniform_mean", None)
    if step is not None:
        result = step(inp, mean, max(int(count), 1))
        assert isinstance(result, AggregateResult)
        return result
    one = SiteUpdate(site_id=SECURE_SUM, tensors=dict(mean), n_samples=max(int(count), 1), local_steps=0)
    return strategy.aggregate_train(replace(inp, updates=[one]))


def mean_refusal(strategy: object) -> str | None:
    """Why `strategy` (configured) cannot aggregate from the mean the PS unmasks for it (the plain mean for a rule
    with `sums_uniform`, else the sample-weighted one); None when it can."""
    if getattr(strategy, "sums_uniform", False):
        check = getattr(strategy, "uniform_mean_refusal", None)
        refusal = check() if check is not None else None
        return refusal if isinstance(refusal, str) else None
    return weighted_mean_refusal(strategy)


def weighted_mean_refusal(strategy: object) -> str | None:
    """Why `strategy` (configured) cannot aggregate from the weighted mean alone; None when it can."""
    check = getattr(strategy, "weighted_mean_refusal", None)
    if check is None:
        return f"{getattr(strategy, 'name', strategy)} does not aggregate from the weighted mean of the updates alone"
    refusal = check()
    return refusal if isinstance(refusal, str) else None


@dataclass(frozen=True)
class LabelSums:
    """Per-label sums over the sites in a secure sum (FedFBN's surgical output layer, fedmqtt/secagg/weighted.py):
    `weight[r]` sum_i p_i m_ir, `holders[r]` how many sites annotate label r (m_ir = 1), and per output tensor
    `rows[name][r]` sum_i p_i m_ir row_ir: row r's mean over its holders is rows[name][r] / weight[r]."""

    weight: np.ndarray
    holders: np.ndarray
    rows: Mapping[str, np.ndarray]


def aggregate_from_label_sums(strategy: Strategy, inp: RoundInput, mean: Mapping[str, np.ndarray], count: int,
                              sums: LabelSums) -> AggregateResult:
    """The aggregate of a rule that averages its output rows label by label (`sums_label_rows`, FedFBN surgical):
    the plain mean of the other tensors, each output row from its label's sums. ValueError for another rule."""
    step = getattr(strategy, "aggregate_from_label_sums", None)
    if not getattr(strategy, "sums_label_rows", False) or step is None:
        raise ValueError(f"{strategy.name} does not aggregate output rows label by label")
    result = step(inp, mean, max(int(count), 1), sums)
    assert isinstance(result, AggregateResult)
    return result


@dataclass(frozen=True)
class NormalisedSums:
    """FedNova's sums over the sites in a secure sum (sites with a_i = 0 add 0 to `scaled` and `inverse_work`):
    `weight` P = sum p_i, `scaled` sum p_i y_i / a_i per TRAIN tensor, `work` sum p_i a_i, `steps` sum p_i tau_i,
    `inverse_work` sum p_i / a_i."""

    weight: float
    scaled: Mapping[str, np.ndarray]
    work: float
    steps: float
    inverse_work: float


def aggregate_from_sums(strategy: Strategy, inp: RoundInput, mean: Mapping[str, np.ndarray],
                        sums: NormalisedSums) -> AggregateResult:
    """The aggregate of a rule that steps from FedNova's sums (`sums_normalised`); `mean` is the weighted mean
    of the float tensors (float buffers take it) with the server's integer buffers. ValueError for another rule."""
    step = getattr(strategy, "aggregate_from_sums", None)
    if not getattr(strategy, "sums_normalised", False) or step is None:
        raise ValueError(f"{strategy.name} does not aggregate from normalised sums")
    result = step(inp, mean, sums)
    assert isinstance(result, AggregateResult)
    return result
