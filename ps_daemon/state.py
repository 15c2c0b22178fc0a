"""DaemonState: everything the PS knows, immutable; `machine.step` returns a new one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fedmqtt.strategies.base import Manifest, SiteUpdate, Weights
from schemas.feature_stats import FeatureStatistics, FeatureSummary
from schemas.messages import PrivacyPolicy

if TYPE_CHECKING:
    from ps_daemon.best_file import StoredWeights
    from ps_daemon.secure_round import SecureRound

# The phases a checkpoint can hold (schemas.checkpoint.Checkpoint.phase): a round or the final evaluation.
CheckpointPhase = Literal["training", "evaluating"]
Phase = Literal["waiting_for_sites", "training", "evaluating", "done"]
MetricMap = Mapping[str, float | None]


@dataclass(frozen=True)
class ReceivedUpdate:
    update: SiteUpdate
    train_loss: float | None
    val_metrics: MetricMap
    undefined: Mapping[str, str]
    no_step_reason: str = ""  # an answer without an update (the site could not take a step): not aggregated


@dataclass(frozen=True)
class RoundRecord:
    """One closed round: who took part, and the validation metrics of the model they received."""

    round: int
    sites: tuple[str, ...]
    stragglers: tuple[str, ...]
    per_site: Mapping[str, MetricMap]
    mean: MetricMap
    train_loss: float | None
    n_samples: Mapping[str, int]
    started_at: float
    closed_at: float
    model_hash: str = ""  # the model version the sites trained from in this round
    skipped: Mapping[str, str] = field(default_factory=dict)  # answered without an update: site -> why
    server: Mapping[str, float] = field(default_factory=dict)  # the rule's diagnostics (DP-FedAvg: epsilon, C)
    # Under secure aggregation: "included" (in the sum), "dropped" (selected, not in it), "recovered" (dropped
    # after sharing keys: their masks removed with their rebuilt keys), "tries" (of the round), "clipped" (site ->
    # coordinates the ring clipped, for sites in the sum that said any). Empty in the clear.
    secure: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BestRound:
    """Hwang et al.'s protocol: the round whose model had the best mean validation metric."""

    round: int
    score: float
    weights: Weights | StoredWeights  # in memory when chosen; in its own file after the next checkpoint
    model_hash: str


@dataclass(frozen=True)
class FinalReport:
    metrics: Mapping[str, MetricMap]  # by split; "best.<split>" for the site's best-round model
    n_samples: Mapping[str, int]
    undefined: Mapping[str, str]
    best_round: int | None = None


@dataclass(frozen=True)
class DaemonState:
    phase: Phase
    round: int  # the round being trained; rounds + 1 while the final model is evaluated
    weights: Weights  # every tensor of the model; only the strategy's shared ones travel after round 1
    model_hash: str  # hash of the tensors published for this round
    manifest: Manifest = field(default_factory=dict)
    enrolled: Mapping[str, int] = field(default_factory=dict)  # n_i of every site seen (from its status)
    personal: Mapping[str, Weights] = field(default_factory=dict)  # per-site tensors (ps/task/<site>)
    extras: Mapping[str, Weights] = field(default_factory=dict)  # server state sent with the model
    histograms: Mapping[str, tuple[float, ...] | None] = field(default_factory=dict)  # from site statuses
    # Each site's privacy policy from its status, checked against the run before round 1 (ps_daemon.policy_quorum).
    # Not checkpointed: only the wait for round 1 reads it, and a checkpoint holds a run past that (a --resume before
    # round 1 has no checkpoint and reads every site's retained status, policy included, again). The check is the
    # PS's forecast only: each site judges every task by its own policy (site_agent.policy), resumed PS or not.
    policies: Mapping[str, PrivacyPolicy | None] = field(default_factory=dict)
    # With feature_statistics = "federated" (ps_daemon.feature_gate): the sites' summaries while the PS waits for
    # round 1, then the federation's statistics (kept in their own file in out_dir, not in the checkpoint).
    feature_summaries: Mapping[str, FeatureSummary] = field(default_factory=dict)
    # What a site's latest status says is wrong (state "error"), shown where the PS waits for that site. Not
    # checkpointed: every site's retained status says it again.
    site_errors: Mapping[str, str] = field(default_factory=dict)
    feature_statistics: FeatureStatistics | None = None
    recruited: tuple[str, ...] | None = None  # None: no recruitment in this run
    recruitment: Mapping[str, Any] | None = None  # ranking, scores, threshold (for report and manifest)
    selected: tuple[str, ...] = ()
    online: frozenset[str] = frozenset()
    offline: frozenset[str] = frozenset()  # seen going offline (Will); never-seen sites are not in it
    offline_since: Mapping[str, float] = field(default_factory=dict)  # each site in `offline`: when it went
    updates: Mapping[str, ReceivedUpdate] = field(default_factory=dict)
    round_started_at: float = 0.0
    deadline: float | None = None
    history: tuple[RoundRecord, ...] = ()
    best: BestRound | None = None
    final_reports: Mapping[str, FinalReport] = field(default_factory=dict)
    strategy_state: Mapping[str, Any] = field(default_factory=dict)
    # The commit rule (docs/algorithms.md 0.6): per site, the round of its last update that was aggregated.
    accepted_rounds: Mapping[str, int] = field(default_factory=dict)
    session: str = ""  # this start of the run (kept by --resume): part of every task's and model's identity
    attempt: int = 0  # how often the open round was re-published after a stall (new message ids each time)
    last_progress: float = 0.0  # when the open round last started, got an update or a report
    # evaluation = "all": the validation metrics of the open round's model that sites not selected to train sent
    # (site -> metrics; a selected site's come with its update); the round closes only with every site's. Not
    # checkpointed: a checkpoint is taken as a round opens, and a resumed round asks the sites again.
    validated: Mapping[str, MetricMap] = field(default_factory=dict)
    # The open round's secure aggregation (None in the clear, and in a checkpoint: a resumed round starts a new try)
    secure: SecureRound | None = None
