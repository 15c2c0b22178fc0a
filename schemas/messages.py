"""Every payload kind, discriminated on `kind`. Topics, directions and schemas: docs/protocol.md."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

# FiniteFloat is imported for callers that used it from here before it moved to schemas.base.
from schemas.base import (  # noqa: F401
    ID_PATTERN,
    MAX_COUNT,
    MAX_MAP_ENTRIES,
    MAX_ROUND,
    MAX_SECONDS,
    MAX_SITES,
    MAX_TENSORS,
    Count,
    Detail,
    FiniteFloat,
    Frozen,
    Header,
    Label,
    Name,
    NonNegativeSeconds,
    Real,
    RoundNo,
    Session,
    SiteName,
    Timestamp,
)
from schemas.chunks import Chunk, ChunkManifest
from schemas.feature_stats import FeatureStatistics, FeatureSummary
from schemas.secagg import (
    MAX_LABEL_ROWS,
    SecAggAdvert,
    SecAggAnswer,
    SecAggInbox,
    SecAggMasked,
    SecAggRoster,
    SecAggShares,
    SecAggTerms,
    SecAggUnmask,
    TensorName,
)
from schemas.signed import KeyList
from schemas.tensors import Tensors

# Every field below is bounded (see schemas.base for why): numbers finite and in range, strings and maps short.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # what torch and numpy seeds accept
Scalar = bool | Int64 | Real | Label
# None: undefined on that split (the reason travels beside it). NaN/Inf are refused: they would
# poison means and best-round selection, and JSON has no spelling for them.
MetricValue = Real | None
Metrics = Annotated[dict[Name, MetricValue], Field(max_length=MAX_MAP_ENTRIES)]
Reasons = Annotated[dict[Name, Detail], Field(max_length=16 * MAX_MAP_ENTRIES)]  # "<split>.<metric>" -> why
# Class index -> count; as many bins as the PS's admission allows (it also checks that keys are class indices).
LabelHistogram = Annotated[dict[Annotated[str, Field(max_length=16)], Count], Field(max_length=100_000)]
SiteNames = Annotated[tuple[SiteName, ...], Field(max_length=MAX_SITES)]
MAX_SPLITS = 64  # "val", "test", "best.val", ...
# A label set names output rows: far more than any classifier's outputs is not one (the PS checks the model's).
MAX_OUTPUT_LABELS = 100_000


class ModelSpec(Frozen):
    """Which model to build and with which arguments (a registry name, never code)."""

    name: str = Field(pattern=r"^[a-z0-9_]+$", max_length=64, description="a model of the registry "
                      "(fedmqtt/training/models.py), e.g. `mlp`")
    args: Annotated[dict[Name, Scalar | Annotated[list[Int64], Field(max_length=1024)]],
                    Field(max_length=MAX_MAP_ENTRIES)] = Field(default_factory=dict, description="the model's "
                                                               "constructor arguments, e.g. in_features, hidden")


class RecordDP(Frozen):
    """Record-level DP-SGD every site trains with (Abadi et al., Deep Learning with Differential Privacy).

    Poisson-sampled batches, each record's gradient clipped to `max_grad_norm`, Gaussian noise of std
    `noise_multiplier * max_grad_norm` on the batch sum (Opacus). Give the noise, or the epsilon to spend over the
    planned rounds (the site derives the noise from it). docs/privacy.md."""

    max_grad_norm: float = Field(gt=0, le=1e6, allow_inf_nan=False, description="C: each record's gradient is "
                                 "clipped to this L2 norm before the batch's gradients are summed")
    noise_multiplier: float | None = Field(default=None, ge=0, le=1e4, allow_inf_nan=False, description="sigma: the "
                                           "Gaussian noise on each batch's clipped sum has std sigma * C (give "
                                           "this or target_epsilon)")
    target_epsilon: float | None = Field(default=None, gt=0, le=1e4, allow_inf_nan=False, description="instead of "
                                         "noise_multiplier: the noise that spends this epsilon (at `delta`) over "
                                         "planned_rounds rounds of `epochs` local epochs")
    planned_rounds: int | None = Field(default=None, ge=1, le=MAX_ROUND, description="rounds the target_epsilon "
                                       "is spread over (unset: the PS config's `rounds`)")
    delta: float = Field(default=1e-5, gt=0, lt=1, allow_inf_nan=False, description="the delta at which epsilon is "
                         "reported; choose it well below 1 / (records at a site)")
    accountant: Literal["rdp", "prv"] = Field(default="rdp", description="Opacus' accountant: rdp (Renyi DP, "
                                              "Mironov) or prv (privacy random variables, Gopi et al.)")
    engine: Literal["auto", "fused", "opacus", "torch.func"] = Field(default="auto", description="who computes the "
                                                                     "per-record gradients: fused (one backward pass, "
                                                                     "per-layer norms and clipped sums; sequential "
                                                                     "models of Linear, Conv, GroupNorm and LayerNorm "
                                                                     "layers), opacus (ghost clipping), torch.func "
                                                                     "(vmap; layers it batches only), or auto: fused "
                                                                     "where it serves the model, else torch.func for a "
                                                                     "convolutional model it serves whose batch of "
                                                                     "per-record gradients stays under 8 Mi floats, "
                                                                     "else opacus. The same clipping, noise "
                                                                     "distribution, sampling and accountant in each")

    @model_validator(mode="after")
    def _noise_or_target(self) -> RecordDP:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("record-level DP needs exactly one of noise_multiplier and target_epsilon")
        return self


class PrivacySpent(Frozen):
    """What record-level DP has cost a site's training records so far (all its rounds, all runs on this data),
    by its own accountant, sent with each update so the PS can show it."""

    epsilon: float = Field(ge=0, le=1e9, allow_inf_nan=False)
    delta: float = Field(gt=0, lt=1, allow_inf_nan=False)
    accountant: Literal["rdp", "prv"] = "rdp"
    noise_multiplier: float = Field(ge=0, le=1e4, allow_inf_nan=False)
    sample_rate: float = Field(gt=0, le=1, allow_inf_nan=False)
    steps: Count  # DP-SGD steps in the accountant's history, this round's included


class ParticipantDP(Frozen):
    """Participant-level DP (DP-FedAvg, docs/privacy.md) that the run's released models are under, as the PS
    declares it with every training task. A site does not take it on trust: it recomputes the run's epsilon from
    these terms with its own accountant (no amplification by sampling: q = 1) and refuses a run its `[privacy]`
    policy does not allow (site_agent/policy.py)."""

    mechanism: Literal["gaussian", "skellam"] = Field(description="gaussian: the PS adds the noise to the sum of "
                                                      "clipped changes; skellam: each site adds its share in the "
                                                      "ring under secure aggregation (the task's "
                                                      "secure_aggregation.distributed_dp says how much)")
    noise_multiplier: float = Field(ge=0, le=1e4, allow_inf_nan=False, description="z: noise of std z times the "
                                    "sensitivity on each round's sum (under adaptive clipping z covers the change "
                                    "and the clipped count together)")
    rounds: int = Field(ge=1, le=MAX_ROUND, description="the rounds the run releases a model in: each is one "
                        "release the site's accountant charges")
    delta: float = Field(gt=0, lt=1, allow_inf_nan=False, description="the delta at which the run's epsilon is "
                         "stated")


ParticipantAccountant = Literal["rdp", "prv", "skellam"]


class ParticipantSpent(Frozen):
    """What participant-level DP (DP-FedAvg, docs/privacy.md) has cost the run's released models so far: epsilon at
    the run's delta after `rounds` charged releases, by the PS's accountant (q = 1, no amplification by sampling):
    rdp or prv (the smaller of Opacus' two) for the Gaussian mechanism in the clear, skellam (the Skellam
    mechanism's RDP bound) for distributed DP under secure aggregation."""

    epsilon: float = Field(ge=0, le=1e9, allow_inf_nan=False, description="epsilon at `delta` of every release so "
                           "far")
    delta: float = Field(gt=0, lt=1, allow_inf_nan=False, description="the run's participant-level delta")
    accountant: ParticipantAccountant = Field(description="whose bound `epsilon` is")
    rounds: int = Field(ge=0, le=MAX_ROUND, description="the releases (rounds) the accountant has charged")
    round: RoundNo = Field(description="the last closed round it counts")


class TrainSettings(Frozen):
    """Local-training settings the PS sends with each task."""

    algorithm: str = Field(default="fedavg", max_length=64, description="the client rule to train with; the PS "
                           "sends its config's `algorithm` here")
    epochs: int = Field(default=1, ge=1, le=1_000_000, description="local epochs per round")
    # e.g. "4 local epochs of 3 batches of 50": at most this many batches per epoch (None: all)
    steps_per_epoch: int | None = Field(default=None, ge=1, le=MAX_COUNT, description="at most this many batches "
                                        "per epoch (unset: the whole training split)")
    batch_size: int = Field(default=16, ge=1, le=2**31, description="rows per local batch")
    lr: float = Field(default=1e-3, gt=0, le=1e6, allow_inf_nan=False, description="local learning rate")
    optimizer: Literal["sgd", "adam", "adamw"] = Field(default="adam", description="local optimiser (SCAFFOLD "
                                                       "and FedNova need sgd)")
    weight_decay: float = Field(default=0.0, ge=0, le=1e6, allow_inf_nan=False, description="local L2 weight "
                                "decay")
    seed: Int64 = Field(default=0, description="local-training seed, from which each site and round derive their "
                         "own; the PS sends its config's `seed` here")
    # auto: BCE for binary and (masked) multilabel, cross-entropy for multiclass, MSE for regression
    loss: Literal["auto", "bce", "ce", "mse", "msle"] = Field(default="auto", description="auto: BCE for binary "
                                                              "and multilabel, cross-entropy for multiclass, MSE "
                                                              "for regression")
    hyper: Annotated[dict[Name, Real], Field(max_length=MAX_MAP_ENTRIES)] = Field(
        default_factory=dict, description="local-optimiser options: momentum, nesterov, balance_classes "
        "(the algorithm's own keys go in the PS config's `hyper`)")
    dp: RecordDP | None = Field(default=None, description="record-level differential privacy (DP-SGD) every site "
                                "trains with (docs/privacy.md); unset: none")


class GlobalModel(Header):
    """`ps/model`: the global model of round `round` (shared tensors only)."""

    kind: Literal["global_model"] = "global_model"
    # Which start of the run this belongs to (a fresh `ps start` draws a new one; `--resume` keeps it), so a
    # site never mistakes a new run with the same id and seed for one it has already served.
    session: Session = ""
    model: ModelSpec
    model_hash: Label
    tensors: Tensors
    # Server state every site needs, by name: e.g. "c" (SCAFFOLD control variate), "eval" (the model
    # to validate when it differs from the one to train, FedDyn's theta_avg).
    extras: Annotated[dict[Name, Tensors], Field(max_length=64)] = Field(default_factory=dict)


class TrainTask(Header):
    """`ps/task/<site>`: train the global model `model_hash` for round `round`."""

    kind: Literal["train_task"] = "train_task"
    # Which start of the run this belongs to (a fresh `ps start` draws a new one; `--resume` keeps it), so a
    # site never mistakes a new run with the same id and seed for one it has already served.
    session: Session = ""
    site_id: str = Field(pattern=ID_PATTERN)
    model_hash: Label
    deadline: Timestamp
    settings: TrainSettings
    # The commit rule: the round of this site's last update the PS aggregated.
    accepted_round: RoundNo | None = None
    tensors: Tensors = ()  # personalised tensors for this site only (AdaFed psi_i)
    # tensor names to send back (None: all); the rest stays local
    upload: Annotated[tuple[Label, ...], Field(max_length=MAX_TENSORS)] | None = None
    best_round: RoundNo | None = None  # Hwang et al.: the round whose model is best so far (sites keep that model)
    # Set when the round runs under secure aggregation (docs/secure-aggregation.md): the site then sends its update
    # masked, in the ring these terms describe; a site whose policy requires secure aggregation refuses a task
    # without them.
    secure_aggregation: SecAggTerms | None = None
    # Set when the run releases its models under participant-level DP (algorithm dp-fedavg): the site judges these
    # terms against its own policy with its own accountant before it trains (docs/privacy.md).
    participant_dp: ParticipantDP | None = None
    # In the clear, the output tensors the rule averages label by label (FedFBN surgical, one row per label): the
    # site then names the labels its data annotate in its update's `label_set`. Under secure aggregation the terms
    # carry them instead (the PS learns only how many sites annotate each label, never which).
    per_label_tensors: Annotated[tuple[TensorName, ...], Field(max_length=MAX_LABEL_ROWS)] = ()

    @model_validator(mode="after")
    def _label_rows_in_the_clear_only(self) -> TrainTask:
        if self.per_label_tensors and self.secure_aggregation is not None:
            raise ValueError("per_label_tensors go in the task only in the clear; under secure aggregation the "
                             "terms carry them")
        return self


# The tag of the evaluation task that asks a site not selected to train to validate the open round's model, and of
# its report (evaluation = "all", docs/algorithms.md 17.1): splits ("val",); the final evaluation's tag is "final".
ROUND_VALIDATION_TAG = "round"


class EvalTask(Header):
    """`ps/task/<site>`: evaluate the global model `model_hash` on the named splits."""

    kind: Literal["eval_task"] = "eval_task"
    # Which start of the run this belongs to (a fresh `ps start` draws a new one; `--resume` keeps it), so a
    # site never mistakes a new run with the same id and seed for one it has already served.
    session: Session = ""
    site_id: str = Field(pattern=ID_PATTERN)
    model_hash: Label
    tag: Name = "final"
    splits: Annotated[tuple[Literal["train", "val", "test"], ...], Field(max_length=3)] = ("val", "test")
    accepted_round: RoundNo | None = None
    tensors: Tensors = ()
    best_round: RoundNo | None = None


class RecruitmentResult(Header):
    """`ps/task/<site>`: whether this site was recruited (docs/algorithms.md 15), with its score and rank."""

    kind: Literal["recruitment_result"] = "recruitment_result"
    # Which start of the run this belongs to (a fresh `ps start` draws a new one; `--resume` keeps it), so a
    # site never mistakes a new run with the same id and seed for one it has already served.
    session: Session = ""
    site_id: str = Field(pattern=ID_PATTERN)
    recruited: bool
    score: Real | None = None
    rank: Annotated[int, Field(ge=0, le=MAX_SITES * 100)] | None = None
    candidates: Annotated[int, Field(ge=0, le=MAX_SITES * 100)] = 0
    detail: Detail = ""


class ResourceUsage(Frozen):
    """What one local round cost the site: wall and CPU seconds, and on NVIDIA GPUs energy and load."""

    device: Label
    wall_s: NonNegativeSeconds
    cpu_s: NonNegativeSeconds  # process CPU time (all threads) spent in local training
    # NVML total-energy counter difference; None off NVIDIA or if unsupported
    energy_j: Annotated[float, Field(allow_inf_nan=False, ge=0, le=1e15)] | None = None
    # mean NVML utilisation sampled during training
    gpu_util_pct: Annotated[float, Field(allow_inf_nan=False, ge=0, le=100)] | None = None
    gpu_peak_mem_mb: Annotated[float, Field(allow_inf_nan=False, ge=0, le=1e12)] | None = None
    amp: Annotated[str, Field(max_length=32)] | None = None  # autocast dtype, e.g. "bfloat16"; None in full precision


class ClientUpdate(Header):
    """`site/<site>/update`: a site's full post-training tensors and what the PS needs to weigh them; or, with
    `no_step_reason`, why it could not take a single training step (no tensors then)."""

    kind: Literal["client_update"] = "client_update"
    session: Session = ""  # the session of the task it answers: an update of an earlier start is never taken
    base_model_hash: Label
    tensors: Tensors
    n_samples: Count
    local_steps: Count
    train_loss: Real | None = None
    val_metrics: Metrics = Field(default_factory=dict)
    undefined: Reasons = Field(default_factory=dict)
    control_variates: Tensors = ()  # SCAFFOLD: Delta c_i
    # e.g. FedNova "a_norm"
    scalars: Annotated[dict[Name, Real], Field(max_length=MAX_MAP_ENTRIES)] = Field(default_factory=dict)
    # AdaFed: per layer "<layer>/mean" and "<layer>/var": aggregate statistics of layer inputs
    layer_stats: Tensors = ()
    label_histogram: LabelHistogram | None = None
    compute_seconds: NonNegativeSeconds = 0.0
    usage: ResourceUsage | None = None
    done: bool = True
    # Set when the site could not take a single optimiser step this round (e.g. no labelled training row, or one
    # row, whose batch of one is dropped): it answers with local_steps = 0, no tensors and this reason, and the PS
    # closes the round without it instead of waiting for an update that can never come.
    no_step_reason: Detail = ""
    # Record-level DP (settings.dp): the epsilon this site's training records have spent, this round included.
    privacy: PrivacySpent | None = None
    # Asked for by a task with per_label_tensors (FedFBN surgical, in the clear): the output rows, i.e. labels, this
    # site's data annotate, as increasing row indices (integers, never a string or bool read as one); () annotates
    # none. The PS checks them against the model.
    label_set: Annotated[tuple[Annotated[int, Field(strict=True, ge=0, lt=MAX_OUTPUT_LABELS)], ...],
                         Field(max_length=MAX_OUTPUT_LABELS)] | None = None

    @model_validator(mode="after")
    def _no_step_answer_carries_nothing_to_aggregate(self) -> ClientUpdate:
        if self.no_step_reason and (self.local_steps or self.tensors or self.control_variates or self.layer_stats
                                    or self.scalars or self.label_set is not None):
            raise ValueError("an update with no_step_reason has local_steps 0 and carries no tensors, control "
                             "variates, layer statistics, scalars or label set")
        return self

    @model_validator(mode="after")
    def _label_set_increasing(self) -> ClientUpdate:
        labels = self.label_set or ()
        if any(b <= a for a, b in zip(labels, labels[1:], strict=False)):
            raise ValueError("label_set lists each label's row index once, in increasing order")
        return self


class EvalReport(Header):
    """`site/<site>/report`: metrics of one model version on a site's own splits."""

    kind: Literal["eval_report"] = "eval_report"
    session: Session = ""
    model_hash: Label
    tag: Name
    # by split; "best.<split>": the site's best-round model
    metrics: Annotated[dict[Name, Metrics], Field(max_length=MAX_SPLITS)]
    n_samples: Annotated[dict[Name, Count], Field(max_length=MAX_SPLITS)]
    undefined: Reasons = Field(default_factory=dict)
    best_round: RoundNo | None = None  # the round of the model behind the "best.*" entries


PolicyNames = Annotated[tuple[Annotated[str, Field(max_length=64)], ...], Field(max_length=256)]


class PrivacyPolicy(Frozen):
    """What this site accepts. Every rule is off by default (the site trains whatever the run asks).

    The `[privacy]` table of a site's config (docs/privacy.md), enforced by the site itself before it trains, and
    published in its status so the PS can check a run against it before round 1."""

    max_epsilon: float | None = Field(default=None, gt=0, le=1e4, allow_inf_nan=False, description="record-level "
                                      "DP budget of this site's training records, over all rounds and runs: a round "
                                      "whose spending (computed ahead by the accountant) would exceed it is refused; "
                                      "set, it also refuses tasks without record-level DP")
    max_delta: float | None = Field(default=None, gt=0, lt=1, allow_inf_nan=False, description="the largest delta "
                                    "this site accepts in a task's record-level DP")
    require_record_dp: bool = Field(default=False, description="refuse every task that does not train with "
                                    "record-level DP (train.dp in the PS config)")
    min_records_per_update: int = Field(default=0, ge=0, le=10**9, description="refuse to send an update computed "
                                        "from fewer labelled training records than this")
    require_secure_aggregation: bool = Field(default=False, description="refuse every training task that does not "
                                             "run under secure aggregation (the PS config's secure_aggregation; "
                                             "docs/secure-aggregation.md), so the PS never sees this site's own "
                                             "update")
    algorithms: PolicyNames | None = Field(default=None, description="the algorithms this site trains with (unset: "
                                           "any)")
    models: PolicyNames | None = Field(default=None, description="the models of the registry this site trains (unset: "
                                 "any)")
    max_rounds: int | None = Field(default=None, ge=1, le=10**6, description="refuse training tasks of a later round")
    max_epochs: int | None = Field(default=None, ge=1, le=10**6, description="refuse tasks with more local epochs "
                                   "per round")
    max_participant_epsilon: float | None = Field(default=None, gt=0, le=1e4, allow_inf_nan=False, description=
                                                  "participant-level DP budget of a run (DP-FedAvg: the released "
                                                  "models against this whole hospital): the site recomputes the "
                                                  "run's epsilon from the task's terms with its own accountant and "
                                                  "refuses a run above it; set, it also refuses runs without "
                                                  "participant-level DP")
    min_participant_noise_multiplier: float | None = Field(default=None, gt=0, le=1e4, allow_inf_nan=False,
                                                           description="refuse a run whose participant-level noise "
                                                           "multiplier is lower (and runs without participant-level "
                                                           "DP); under distributed DP this site also adds at least "
                                                           "its share of this much noise, whatever the PS asks")
    label_histogram_epsilon: float | None = Field(default=None, gt=0, le=100, allow_inf_nan=False, description="with "
                                                  "share_label_histogram: release the label counts once, with "
                                                  "noise (label_histogram_noise) that spends this epsilon, charged "
                                                  "to the privacy ledger; unset: the exact counts")
    label_histogram_noise: Literal["gaussian", "laplace"] = Field(default="gaussian", description="the label "
                                                                  "histogram's mechanism: gaussian ((epsilon, delta) "
                                                                  "at max_delta, else 1e-5) or laplace (pure "
                                                                  "epsilon, no delta)")


SiteState = Literal["online", "training", "update_ready", "evaluating", "offline", "error"]
PsState = Literal["waiting_for_sites", "training", "evaluating", "done", "offline", "error"]


class SiteStatus(Header):
    """`site/<site>/status` (retained; also the Last Will with state 'offline'). JSON on the wire."""

    kind: Literal["site_status"] = "site_status"
    # update_ready: the round's update (`round` above) is stored and too large for one message; the site waits
    # for an upload turn on ps/turn/<site> before putting it on the broker (docs/protocol.md, "Upload turns").
    state: SiteState
    device: Label = "cpu"
    n_train: Count = 0
    n_val: Count = 0
    n_test: Count = 0
    label_histogram: LabelHistogram | None = None
    detail: Detail = ""
    version: Annotated[str, Field(max_length=64)] = ""
    update_bytes: Count = 0  # with update_ready: the encoded update's size
    # The site's privacy policy (None from a site that predates it): the PS checks its run against every site's
    # before round 1, and waits, naming them and their rules, while fewer than `quorum` sites would accept it.
    privacy_policy: PrivacyPolicy | None = None


class SecureRoundNote(Frozen):
    """How secure aggregation went in one closed round (docs/secure-aggregation.md): sites in the sum, selected
    sites left out of it, those among them whose masks were removed with their rebuilt keys, and the tries."""

    round: RoundNo
    included: Count
    dropped: Count
    recovered: Count
    tries: Count
    clipped: Count = 0  # sites in the sum whose values the ring's range clipped (each said how many coordinates)


class DaemonStatus(Header):
    """`ps/status` (retained; also the PS Last Will). JSON on the wire."""

    kind: Literal["daemon_status"] = "daemon_status"
    state: PsState
    algorithm: Annotated[str, Field(max_length=64)] = ""
    # The validation metric whose round mean picks the best round (the PS's selection_metric), so an observer
    # marks the same best round as the run's report.
    selection_metric: Name = ""
    rounds_total: Annotated[int, Field(ge=0, le=MAX_ROUND)] = 0
    sites_expected: SiteNames = ()
    sites_online: SiteNames = ()
    waiting_for: SiteNames = ()  # selected sites that have not answered and can still answer (not seen offline)
    # Selected sites the open round (or the final evaluation) goes on without, each with why: "offline since
    # <UTC time>", "no step possible: ...", "deadline missed: no final report". The PS names at most 64.
    dropped: Annotated[dict[SiteName, Label], Field(max_length=MAX_SITES)] = Field(default_factory=dict)
    deadline: Timestamp | None = None
    # Updates needed to close a round at its deadline, and sites needed online before round 1.
    quorum: Annotated[int, Field(ge=0, le=MAX_SITES)] = 0
    min_sites: Annotated[int, Field(ge=0, le=MAX_SITES)] = 0
    detail: Detail = ""
    session: Session = ""
    # Messages the PS refused, per sending site and reason (bounded: the top reasons per site only).
    rejected: Annotated[dict[Name, Annotated[dict[Name, Count], Field(max_length=64)]],
                        Field(max_length=MAX_SITES)] = Field(default_factory=dict)
    # Sites whose large update of this round the PS takes now, each with its grant number (for observers: each site
    # learns of its own turn on ps/turn/<site>).
    upload_turns: Annotated[dict[SiteName, Count], Field(max_length=MAX_SITES)] = Field(default_factory=dict)
    # Record-level DP: the epsilon each site reported with its newest accepted update (at its delta).
    epsilon: Annotated[dict[SiteName, PrivacySpent], Field(max_length=MAX_SITES)] = Field(default_factory=dict)
    # Participant-level DP (DP-FedAvg): what the released models have cost so far, from the closed rounds' records
    # (so a resumed PS says it too). None when the run's rule releases its models without it.
    participant_dp: ParticipantSpent | None = None
    # Secure aggregation on for this run (the PS sees only sums), and how the last closed round went under it.
    secure_aggregation: bool = False
    secure_last_round: SecureRoundNote | None = None


class RoundMetrics(Header):
    """`ps/metrics` (retained): the summary of one round. JSON on the wire, for any MQTT client."""

    kind: Literal["round_metrics"] = "round_metrics"
    phase: Literal["train", "final"] = "train"
    sites: SiteNames
    stragglers: SiteNames = ()
    per_site: Annotated[dict[Name, Metrics], Field(max_length=MAX_SITES)]
    mean: Metrics
    train_loss: Real | None = None
    # Wall-clock difference on the PS: finite, but not asserted >= 0 (a clock step back must not stop the PS)
    duration_s: Annotated[float, Field(allow_inf_nan=False, ge=-MAX_SECONDS, le=MAX_SECONDS)] = 0.0
    # What each accepted update cost its site and weighed on the wire, repeated here because observers may
    # not read the updates themselves (the dashboard shows them live)
    usage: Annotated[dict[Name, ResourceUsage], Field(max_length=MAX_SITES)] = Field(default_factory=dict)
    update_bytes: Annotated[dict[Name, Count], Field(max_length=MAX_SITES)] = Field(default_factory=dict)
    secure: SecureRoundNote | None = None  # under secure aggregation: how this round's sum went
    # Participant-level DP (DP-FedAvg): what the released models have cost after this round
    participant_dp: ParticipantSpent | None = None


class UploadTurn(Header):
    """`ps/turn/<site>` (retained): this site may now upload its large update of `round` (docs/protocol.md,
    "Upload turns"). A site uploads once per grant number; a resumed PS grants again with a new one."""

    kind: Literal["upload_turn"] = "upload_turn"
    session: Session = ""
    site_id: str = Field(pattern=ID_PATTERN)
    grant: Count


Message = Annotated[
    GlobalModel | TrainTask | EvalTask | RecruitmentResult | UploadTurn | ClientUpdate | EvalReport | SiteStatus
    | DaemonStatus | RoundMetrics | ChunkManifest | Chunk | KeyList
    # secure aggregation (docs/secure-aggregation.md), in the order of a round
    | SecAggAdvert | SecAggRoster | SecAggShares | SecAggInbox | SecAggMasked | SecAggUnmask | SecAggAnswer
    # federated feature statistics (docs/data-preparation.md): a site's sums, the federation's statistics
    | FeatureSummary | FeatureStatistics,
    Field(discriminator="kind"),
]

# Kinds that observers read with plain MQTT clients travel as JSON text; the rest as msgpack.
TEXT_KINDS = frozenset({"site_status", "daemon_status", "round_metrics", "key_list", "feature_statistics"})
