"""What can happen to the PS. The runner turns decoded messages and clock ticks into these."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel

from fedmqtt.strategies.base import SiteUpdate
from schemas.feature_stats import FeatureSummary
from schemas.messages import PrivacyPolicy

Metrics = Mapping[str, float | None]


@dataclass(frozen=True)
class Started:
    now: float


@dataclass(frozen=True)
class SiteOnline:
    site_id: str
    now: float
    n_train: int = 0
    histogram: tuple[float, ...] | None = None  # only if the site's egress policy lets it leave
    policy: PrivacyPolicy | None = None  # its privacy policy, as its status published it (None: none published)
    error: str = ""  # its status says "error", and why (e.g. it cannot send a feature summary); "" otherwise


@dataclass(frozen=True)
class SiteOffline:
    site_id: str
    now: float
    since: float | None = None  # when its Will arrived, if the PS held it before believing it (ps_daemon.liveness)


@dataclass(frozen=True)
class UpdateReceived:
    site_id: str
    now: float
    round: int
    base_model_hash: str
    update: SiteUpdate
    train_loss: float | None = None
    val_metrics: Metrics = field(default_factory=dict)
    undefined: Mapping[str, str] = field(default_factory=dict)
    no_step_reason: str = ""  # the site could not take a step: an answer without tensors, left out of the aggregate


@dataclass(frozen=True)
class ReportReceived:
    site_id: str
    now: float
    round: int
    model_hash: str
    tag: str
    metrics: Mapping[str, Metrics]
    n_samples: Mapping[str, int] = field(default_factory=dict)
    undefined: Mapping[str, str] = field(default_factory=dict)
    best_round: int | None = None


@dataclass(frozen=True)
class SecAggReceived:
    """A site's secure aggregation message (schemas/secagg.py: advertisement, shares, masked input, answer),
    checked by the channel (schema, topic, signature)."""

    site_id: str
    now: float
    round: int
    message: BaseModel


@dataclass(frozen=True)
class FeatureSummaryReceived:
    """A site's feature summary (schemas/feature_stats.py), checked by the channel (schema, topic, signature)."""

    site_id: str
    now: float
    summary: FeatureSummary


@dataclass(frozen=True)
class RoundValidated:
    """With `evaluation = "all"`: sites' validation metrics of the open round's model (the model `model_hash`):
    a site's report to its round-validation task (one site per event, checked by ps_daemon.admission first).
    The best round is chosen on every site's (docs/algorithms.md 17.1)."""

    now: float
    round: int
    model_hash: str
    per_site: Mapping[str, Metrics]


@dataclass(frozen=True)
class Tick:
    """The runner's clock: lets the pure machine notice a passed deadline."""

    now: float


Event = (Started | SiteOnline | SiteOffline | UpdateReceived | ReportReceived | SecAggReceived | FeatureSummaryReceived
         | RoundValidated | Tick)
