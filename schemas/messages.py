"""Every payload kind, discriminated on `kind`. Topics and directions: docs/design-notes.md."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from schemas.base import ID_PATTERN, Frozen, Header
from schemas.chunks import Chunk, ChunkManifest
from schemas.tensors import TensorBlob

Scalar = Union[bool, int, float, str]
# None: undefined on that split (the reason travels beside it). NaN/Inf are refused: they would
# poison means and best-round selection, and JSON has no spelling for them.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
MetricValue = Union[FiniteFloat, None]


class ModelSpec(Frozen):
    """Which model to build and with which arguments (a registry name, never code)."""

    name: str = Field(pattern=r"^[a-z0-9_]+$")
    args: dict[str, Scalar | list[int]] = Field(default_factory=dict)


class TrainSettings(Frozen):
    """Local-training settings the PS sends with each task."""

    algorithm: str = "fedavg"
    epochs: int = Field(default=1, ge=1)
    # Seed 003's "4 local epochs of 3 batches of 50": at most this many batches per epoch (None: all)
    steps_per_epoch: int | None = Field(default=None, ge=1)
    batch_size: int = Field(default=16, ge=1)
    lr: float = Field(default=1e-3, gt=0)
    optimizer: Literal["sgd", "adam", "adamw"] = "adam"
    weight_decay: float = Field(default=0.0, ge=0)
    seed: int = 0
    # auto: BCE for binary and (masked) multilabel, cross-entropy for multiclass, MSE for regression
    loss: Literal["auto", "bce", "ce", "mse", "msle"] = "auto"
    hyper: dict[str, float] = Field(default_factory=dict)


class GlobalModel(Header):
    """`ps/model`: the global model of round `round` (shared tensors only)."""

    kind: Literal["global_model"] = "global_model"
    # Which start of the run this belongs to (a fresh `ps start` draws a new one; `--resume` keeps it), so a
    # site never mistakes a new run with the same id and seed for one it has already served.
    session: str = Field(default="", max_length=64, pattern=r"^[0-9a-f]*$")
    model: ModelSpec
    model_hash: str
    tensors: tuple[TensorBlob, ...]
    # Server state every site needs, by name: e.g. "c" (SCAFFOLD control variate), "eval" (the model
    # to validate when it differs from the one to train, FedDyn's theta_avg).
    extras: dict[str, tuple[TensorBlob, ...]] = Field(default_factory=dict)


class TrainTask(Header):
    """`ps/task/<site>`: train the global model `model_hash` for round `round`."""

    kind: Literal["train_task"] = "train_task"
    # Which start of the run this belongs to (a fresh `ps start` draws a new one; `--resume` keeps it), so a
    # site never mistakes a new run with the same id and seed for one it has already served.
    session: str = Field(default="", max_length=64, pattern=r"^[0-9a-f]*$")
    site_id: str = Field(pattern=ID_PATTERN)
    model_hash: str
    deadline: float
    settings: TrainSettings
    # The commit rule (algorithms.md 0.6): the round of this site's last update the PS aggregated.
    accepted_round: int | None = None
    tensors: tuple[TensorBlob, ...] = ()  # personalised tensors for this site only (AdaFed psi_i)
    upload: tuple[str, ...] | None = None  # tensor names to send back (None: all); the rest stays local
    best_round: int | None = None  # seed 000: the round whose model is best so far (sites keep that model)


class EvalTask(Header):
    """`ps/task/<site>`: evaluate the global model `model_hash` on the named splits."""

    kind: Literal["eval_task"] = "eval_task"
    # Which start of the run this belongs to (a fresh `ps start` draws a new one; `--resume` keeps it), so a
    # site never mistakes a new run with the same id and seed for one it has already served.
    session: str = Field(default="", max_length=64, pattern=r"^[0-9a-f]*$")
    site_id: str = Field(pattern=ID_PATTERN)
    model_hash: str
    tag: str = "final"
    splits: tuple[Literal["train", "val", "test"], ...] = ("val", "test")
    accepted_round: int | None = None
    tensors: tuple[TensorBlob, ...] = ()
    best_round: int | None = None


class RecruitmentResult(Header):
    """`ps/task/<site>`: whether this site was recruited (seed 002), with its score and rank."""

    kind: Literal["recruitment_result"] = "recruitment_result"
    # Which start of the run this belongs to (a fresh `ps start` draws a new one; `--resume` keeps it), so a
    # site never mistakes a new run with the same id and seed for one it has already served.
    session: str = Field(default="", max_length=64, pattern=r"^[0-9a-f]*$")
    site_id: str = Field(pattern=ID_PATTERN)
    recruited: bool
    score: FiniteFloat | None = None
    rank: int | None = None
    candidates: int = 0
    detail: str = ""


class ResourceUsage(Frozen):
    """What one local round cost the site: wall and CPU seconds, and on NVIDIA GPUs energy and load."""

    device: str
    wall_s: FiniteFloat = Field(ge=0)
    cpu_s: FiniteFloat = Field(ge=0)  # process CPU time (all threads) spent in local training
    energy_j: FiniteFloat | None = None  # NVML total-energy counter difference; None off NVIDIA or if unsupported
    gpu_util_pct: FiniteFloat | None = None  # mean NVML utilisation sampled during training
    gpu_peak_mem_mb: FiniteFloat | None = None
    amp: str | None = None  # autocast dtype, e.g. "bfloat16"; None in full precision


class ClientUpdate(Header):
    """`site/<site>/update`: a site's full post-training tensors and what the PS needs to weigh them."""

    kind: Literal["client_update"] = "client_update"
    base_model_hash: str
    tensors: tuple[TensorBlob, ...]
    n_samples: int = Field(ge=0)
    local_steps: int = Field(ge=0)
    train_loss: FiniteFloat | None = None
    val_metrics: dict[str, MetricValue] = Field(default_factory=dict)
    undefined: dict[str, str] = Field(default_factory=dict)
    control_variates: tuple[TensorBlob, ...] = ()  # SCAFFOLD: Delta c_i
    scalars: dict[str, FiniteFloat] = Field(default_factory=dict)  # e.g. FedNova "a_norm"
    # AdaFed: per layer "<layer>/mean" and "<layer>/var": aggregate statistics of layer inputs (11.1)
    layer_stats: tuple[TensorBlob, ...] = ()
    label_histogram: dict[str, int] | None = None
    compute_seconds: float = Field(default=0.0, ge=0)
    usage: ResourceUsage | None = None
    done: bool = True


class EvalReport(Header):
    """`site/<site>/report`: metrics of one model version on a site's own splits."""

    kind: Literal["eval_report"] = "eval_report"
    model_hash: str
    tag: str
    metrics: dict[str, dict[str, MetricValue]]  # by split; "best.<split>": the site's best-round model
    n_samples: dict[str, int]
    undefined: dict[str, str] = Field(default_factory=dict)
    best_round: int | None = None  # the round of the model behind the "best.*" entries


class SiteStatus(Header):
    """`site/<site>/status` (retained; also the Last Will with state 'offline'). JSON on the wire."""

    kind: Literal["site_status"] = "site_status"
    state: Literal["online", "training", "evaluating", "offline", "error"]
    device: str = "cpu"
    n_train: int = 0
    n_val: int = 0
    n_test: int = 0
    label_histogram: dict[str, int] | None = None
    detail: str = ""
    version: str = ""


class DaemonStatus(Header):
    """`ps/status` (retained; also the PS Last Will). JSON on the wire."""

    kind: Literal["daemon_status"] = "daemon_status"
    state: Literal["waiting_for_sites", "training", "evaluating", "done", "offline", "error"]
    algorithm: str = ""
    rounds_total: int = 0
    sites_expected: tuple[str, ...] = ()
    sites_online: tuple[str, ...] = ()
    waiting_for: tuple[str, ...] = ()
    deadline: float | None = None
    detail: str = ""
    session: str = Field(default="", max_length=64, pattern=r"^[0-9a-f]*$")
    # Messages the PS refused, per sending site and reason (bounded: the top reasons per site only).
    rejected: dict[str, dict[str, int]] = Field(default_factory=dict)


class RoundMetrics(Header):
    """`ps/metrics` (retained): the summary of one round. JSON on the wire, for any MQTT client."""

    kind: Literal["round_metrics"] = "round_metrics"
    phase: Literal["train", "final"] = "train"
    sites: tuple[str, ...]
    stragglers: tuple[str, ...] = ()
    per_site: dict[str, dict[str, MetricValue]]
    mean: dict[str, MetricValue]
    train_loss: float | None = None
    duration_s: float = 0.0


Message = Annotated[
    Union[GlobalModel, TrainTask, EvalTask, RecruitmentResult, ClientUpdate, EvalReport, SiteStatus, DaemonStatus,
          RoundMetrics, ChunkManifest, Chunk],
    Field(discriminator="kind"),
]

# Kinds that observers read with plain MQTT clients travel as JSON text; the rest as msgpack.
TEXT_KINDS = frozenset({"site_status", "daemon_status", "round_metrics"})
