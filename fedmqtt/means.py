"""Means over sites where a metric is defined (kept free of scikit-learn so the PS stays light)."""

from __future__ import annotations

from collections.abc import Iterable


def mean_defined(values: Iterable[float | None]) -> float | None:
    """Unweighted mean of the values that are not None (algorithms.md 17.1 DECISION); None if none are."""
    defined = [float(v) for v in values if v is not None]
    return sum(defined) / len(defined) if defined else None
