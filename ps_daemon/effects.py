"""What the PS machine asks the runner to do, in order (checkpoint before publish)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel

from fedmqtt.strategies.base import Weights
from schemas.feature_stats import FeatureStatistics
from schemas.messages import ParticipantSpent
from schemas.secagg import SecAggTerms

if TYPE_CHECKING:
    from ps_daemon.state import DaemonState, Phase, RoundRecord


@dataclass(frozen=True)
class SaveCheckpoint:
    state: DaemonState


@dataclass(frozen=True)
class PublishModel:
    round: int
    weights: Weights  # only the tensors that travel this round
    model_hash: str
    extras: Mapping[str, Weights]


@dataclass(frozen=True)
class PublishTrainTask:
    site_id: str
    round: int
    model_hash: str
    deadline: float
    accepted_round: int | None
    tensors: Weights  # personalised tensors for this site
    hyper: Mapping[str, float]  # per-site hyper-parameters (merged into the task's settings)
    upload: tuple[str, ...]  # the strategy's shared tensors: what the site sends back
    best_round: int | None = None
    secure: SecAggTerms | None = None  # under secure aggregation: the ring and the try the site masks for
    per_label: tuple[str, ...] = ()  # in the clear: output tensors averaged label by label (the site sends its labels)


@dataclass(frozen=True)
class PublishEvalTask:
    site_id: str
    round: int
    model_hash: str
    accepted_round: int | None
    tensors: Weights
    best_round: int | None = None
    # "final" (the final evaluation, on val and test) or ROUND_VALIDATION_TAG (evaluation = "all": a site not
    # selected to train validates the open round's model)
    tag: str = "final"
    splits: tuple[Literal["train", "val", "test"], ...] = ("val", "test")


@dataclass(frozen=True)
class PublishSecAgg:
    """A secure aggregation message of the PS (roster, inbox, unmasking request) to one site, on its task topic."""

    site_id: str
    message: BaseModel


@dataclass(frozen=True)
class PublishFeatureStatistics:
    """The federation's feature statistics: kept in the PS's out_dir first (a resumed PS does not ask again), then
    published retained on ps/features."""

    message: FeatureStatistics


@dataclass(frozen=True)
class PublishRecruitment:
    site_id: str
    recruited: bool
    score: float | None
    rank: int | None
    candidates: int
    detail: str


@dataclass(frozen=True)
class PublishStatus:
    state: Phase
    round: int
    waiting_for: tuple[str, ...]  # the selected sites that have not answered and can still answer
    deadline: float | None
    detail: str = ""
    dropped: Mapping[str, str] = field(default_factory=dict)  # selected sites left out of the round -> why
    participant_dp: ParticipantSpent | None = None  # what participant-level DP has cost the released models so far


@dataclass(frozen=True)
class PublishRoundMetrics:
    record: RoundRecord


@dataclass(frozen=True)
class Log:
    level: str  # "info" | "warning"
    text: str


@dataclass(frozen=True)
class Finish:
    state: DaemonState


Effect = (SaveCheckpoint | PublishModel | PublishTrainTask | PublishEvalTask | PublishRecruitment | PublishSecAgg
          | PublishFeatureStatistics | PublishStatus | PublishRoundMetrics | Log | Finish)
