"""Means over sites where a metric is defined, and the best-round rule (no scikit-learn: the PS uses them)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Literal

Direction = Literal["max", "min"]
# Metrics where lower is better: the best round minimises them (docs/algorithms.md 17.1).
LOWER_IS_BETTER: frozenset[str] = frozenset({"loss", "mae", "mape", "mse", "msle"})


def mean_defined(values: Iterable[float | None]) -> float | None:
    """Unweighted mean of the values that are not None (docs/algorithms.md 17.1 DECISION); None if none are."""
    defined = [float(v) for v in values if v is not None]
    return sum(defined) / len(defined) if defined else None


def direction_of(metric: str) -> Direction:
    """"min" for loss-type metrics (loss, mae, mape, mse, msle), "max" otherwise."""
    return "min" if metric in LOWER_IS_BETTER else "max"


def round_score(site_metrics: Mapping[str, Mapping[str, float | None]], metric: str) -> float | None:
    """Unweighted mean of `metric` over the sites where it is defined (None, missing and NaN left out)."""
    found = (m.get(metric) for m in site_metrics.values())
    return mean_defined(v if v is not None and math.isfinite(v) else None for v in found)


def best_round(
    per_round_site_metrics: Mapping[int, Mapping[str, Mapping[str, float | None]]],
    metric: str,
    direction: Direction | None = None,
) -> tuple[int, float] | None:
    """Hwang et al.'s best-round rule with the DECISIONS of docs/algorithms.md 17.1.

    Each round scores the unweighted mean of `metric` over sites where it is defined; a round with
    none defined is not eligible. The search starts at minus infinity (plus infinity for "min"),
    only a strict improvement moves it, so ties keep the earlier round.

    Args:
        per_round_site_metrics: `{round: {site: {metric: value or None}}}` (validation metrics).
        metric: the selection metric, e.g. "auroc", "cinc_score", "loss".
        direction: "max" or "min"; default `direction_of(metric)`.

    Returns:
        `(round, mean score)`, or None when no round is eligible.
    """
    sign = 1.0 if (direction or direction_of(metric)) == "max" else -1.0
    best: tuple[int, float] | None = None
    best_key = -math.inf
    for rnd in sorted(per_round_site_metrics):
        score = round_score(per_round_site_metrics[rnd], metric)
        if score is not None and sign * score > best_key:
            best, best_key = (rnd, score), sign * score
    return best
