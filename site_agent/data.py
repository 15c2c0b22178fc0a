"""Load this site's own file and split/normalise it with local statistics only."""

from __future__ import annotations

from fedmqtt.data.heart_disease import FEATURE_NAMES, load_site_file
from fedmqtt.data.splits import SiteData, split_and_normalise
from site_agent.config import DataSpec


def load_site_data(spec: DataSpec) -> SiteData:
    if spec.format == "heart_disease":
        x, y = load_site_file(spec.path)
        return split_and_normalise(x, y, seed=spec.split_seed, fractions=spec.fractions, feature_names=FEATURE_NAMES)
    raise ValueError(f"unknown data format {spec.format!r}")  # pragma: no cover - pydantic restricts it
