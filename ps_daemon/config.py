"""DaemonConfig: the PS's TOML file, validated by pydantic (errors name the field)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedmqtt.config_io import load_toml, validate_config
from fedmqtt.errors import ConfigError
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.server import MIN_SITES
from fedmqtt.strategies import STRATEGIES, build_strategy
from fedmqtt.strategies.params import LOCAL_OPTIMISER_KEYS, HyperValue, check_local_optimiser
from fedmqtt.strategies.sums import mean_refusal
from fedmqtt.training.client_rules import optimiser_problem, record_dp_problem
from fedmqtt.transport.settings import BrokerSettings, load_credentials
from fedmqtt.transport.signing import KEY_LIST_FILE, Identity, load_identity
from ps_daemon.distributed_dp import distributed_dp_problem
from schemas.base import ID_PATTERN
from schemas.messages import ModelSpec, RecordDP, TrainSettings
from schemas.secagg import DistributedDPTerms, SecAggTerms

# Rules that start from a pretrained model (docs/algorithms.md 11).
NEEDS_PRETRAINED = ("adafed", "d-adafed")
# Rules whose formulas hold for plain SGD only (docs/algorithms.md 7 and 8).
SGD_ONLY = {"scaffold": "SCAFFOLD option II estimates gradients from SGD steps",
            "fednova": "FedNova's ||a_i||_1 is defined for SGD"}


class _Raw(BaseModel):
    """The file's tables before validation (so a CLI override can replace a key first)."""

    model_config = ConfigDict(extra="allow")


class RecruitmentConfig(BaseModel):
    """Recruitment (docs/algorithms.md 15): how a site's score weighs divergence and sample size, and the
    threshold it must pass."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gamma_dv: float = Field(default=0.5, ge=0, description="weight of a site's label-distribution divergence "
                            "in its score")
    gamma_sa: float = Field(default=0.5, ge=0, description="weight of 1/sqrt(the site's sample count) in its "
                            "score")
    gamma_th: float = Field(default=0.1, ge=0, le=1, description="sites join in rank order until their summed "
                            "scores reach this share of the total (0: one site, 1: all)")


class InitModelConfig(BaseModel):
    """Start round 1 from a pretrained model (ps_daemon/init_model_file.py), for every rule."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path = Field(description="safetensors file of the model's tensors (e.g. from `fedmqtt pretrain`); "
                       "validated completely before use (size, dtypes, shapes, finite values); a PS resumed "
                       "before round 1 closed accepts only the file the run started from (its sha256)")
    tensors: Literal["all", "matching"] = Field(default="all", description="\"all\": the file must hold exactly "
                                                "the model's tensors; \"matching\": load the tensors with the "
                                                "model's name, dtype and shape, keep the model's own seeded "
                                                "initialisation for the rest (e.g. a head for another number of "
                                                "classes); the report lists which were loaded and which kept")
    max_bytes: int | None = Field(default=None, ge=1, description="largest file accepted (default: twice the "
                                  "model's own bytes plus 1 MiB)")

    def resolved(self, base: Path) -> InitModelConfig:
        return self if self.path.is_absolute() else self.model_copy(update={"path": base / self.path})


class MetricsConfig(BaseModel):
    """The PS's Prometheus endpoint (docs/monitoring.md): off unless `port` is set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    port: int | None = Field(default=None, ge=1, le=65535, description="serve Prometheus metrics on this TCP port "
                             "(any path, e.g. /metrics); unset: no endpoint")
    bind: str = Field(default="127.0.0.1", pattern=r"^[0-9A-Za-z.:_-]+$", description="address the endpoint "
                      "listens on; loopback unless set: beyond this host, serve it over TLS (`tls_cert`) with "
                      "client certificates (`tls_client_ca`), or behind a firewall or a TLS proxy")
    linger_s: float = Field(default=0.0, ge=0, le=3600, allow_inf_nan=False, description="once the run is done, "
                            "keep serving its final numbers this long (at least one scrape interval, so the last "
                            "scrape sees the end); SIGTERM ends the wait")
    tls_cert: Path | None = Field(default=None, description="PEM certificate (chain) to serve the metrics over "
                                  "HTTPS with; needs `tls_key`; unset: plain HTTP")
    tls_key: Path | None = Field(default=None, description="PEM private key of `tls_cert`; a file only its owner "
                                 "may read")
    tls_client_ca: Path | None = Field(default=None, description="PEM CA certificate(s): with it, only a scraper "
                                       "presenting a client certificate issued by this CA is served (needs "
                                       "`tls_cert`)")

    @model_validator(mode="after")
    def _tls_complete(self) -> MetricsConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("[metrics] tls_cert and tls_key go together: set both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("[metrics] tls_client_ca needs tls_cert and tls_key (client certificates are checked "
                             "over TLS)")
        return self

    def resolved(self, base: Path) -> MetricsConfig:
        """Relative TLS paths are relative to the config file's folder, as the PS's other paths are."""
        def at(p: Path | None) -> Path | None:
            return p if p is None or p.is_absolute() else base / p
        return self.model_copy(update={"tls_cert": at(self.tls_cert), "tls_key": at(self.tls_key),
                                       "tls_client_ca": at(self.tls_client_ca)})


class SecureAggregationConfig(BaseModel):
    """SecAgg+ (docs/secure-aggregation.md), off unless `enabled`: the PS learns only the sum of the updates.

    The ring's clip and scale bound what the sum can hold and how exactly (the rounding error of one coordinate of
    the sum of n sites is at most n / 2^(fraction_bits + 1))."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(default=False, description="run every training round under SecAgg+ (the rule must need "
                          "only sums: `fedmqtt algorithms` says which do)")
    dropout: float = Field(default=0.1, ge=0, lt=0.5, allow_inf_nan=False, description="the fraction of selected "
                           "sites the round is built to lose and still unmask the sum (sets the graph's degree and "
                           "threshold)")
    clip: float = Field(default=8.0, gt=0, le=1e15, allow_inf_nan=False, description="every coordinate a site "
                        "sends (its weight times its update, and its weight) is clipped to [-clip, clip]")
    fraction_bits: int = Field(default=16, ge=0, le=52, description="fixed-point scale 2^fraction_bits: the "
                               "rounding error of one coordinate is at most 2^-(fraction_bits + 1) per site")
    ring_bits: Literal[32, 64] = Field(default=32, description="the ring Z_(2^bits): 4 or 8 bytes a coordinate "
                                       "on the wire; the sum of every site's clip must fit it")
    distributed_dp: Literal["off", "skellam"] = Field(default="off", description="with algorithm = \"dp-fedavg\": "
                                                      "each site clips its model change to clip_norm and adds its "
                                                      "share of Skellam noise in the ring, so nobody sees an "
                                                      "un-noised sum (docs/privacy.md, \"Distributed DP\")")
    stage_timeout_s: float = Field(default=60.0, gt=0, le=86_400, allow_inf_nan=False, description="how long the "
                                   "PS waits for the sites at each stage after the keys (shares, masked inputs, "
                                   "unmasking answers) before it goes on without the missing ones; the shares and "
                                   "masked inputs may wait for local training (the sites advertise as it starts), so "
                                   "those stages also wait until round_timeout_s after the round started; the keys "
                                   "stage waits round_timeout_s")

    def terms(self, n_sites: int, *, attempt: int = 0, weight_bound: float = 1.0, variates: bool = False,
              normalised: bool = False, work_bound: float = 1.0, uniform: bool = False,
              distributed_dp: DistributedDPTerms | None = None, label_rows: tuple[str, ...] = ()) -> SecAggTerms:
        """What each train task carries, for a run of `n_sites` sites (`variates`: the rule sums SCAFFOLD's
        control-variate deltas too; `distributed_dp`: the sites add DP-FedAvg's noise)."""
        return SecAggTerms(ring_bits=self.ring_bits, fraction_bits=self.fraction_bits, clip=self.clip,
                           max_sites=n_sites, dropout=self.dropout, attempt=attempt, weight_bound=weight_bound,
                           variates=variates, normalised=normalised, work_bound=work_bound, uniform=uniform,
                           distributed_dp=distributed_dp, per_label_tensors=label_rows)

    def fixed_point(self, n_sites: int) -> FixedPoint:
        """The ring, checked so that the sum of `n_sites` encodings cannot wrap (ConfigError otherwise)."""
        return FixedPoint(self.clip, self.fraction_bits, self.ring_bits, max_sites=n_sites)


# How a rule's server step reads the unmasked sum (fedmqtt/strategies/rule.py): the sample-weighted mean, the
# plain mean, or FedNova's normalised sums.
UNMASKED_SUMS = ("from_weighted_mean", "sums_uniform", "sums_normalised")


def secure_aggregation_problem(algorithm: str, sa: SecureAggregationConfig, n_sites: int,
                               params: Mapping[str, Any] | None = None) -> str | None:
    """Why this run cannot aggregate securely (None when it can): a rule that needs each site's own update, or
    sums the PS does not unmask (for the rule's `params`), fewer than three sites, or a ring too small for the
    sum."""
    if not sa.enabled:
        return ("secure_aggregation.distributed_dp needs secure aggregation: set enabled = true"
                if sa.distributed_dp != "off" else None)
    if sa.distributed_dp != "off":  # the sites clip and add the noise: the PS sees a noised sum of changes
        return (distributed_dp_problem(algorithm, sa, n_sites, params) or _sites_problem(n_sites)
                or _ring_problem(sa, n_sites))
    rule = STRATEGIES[algorithm]
    if not rule.needs_only_sums:
        return (f"secure_aggregation: {algorithm} cannot run under secure aggregation, the PS would see only the "
                f"sum of the updates and {algorithm} needs more: {rule.sums_note}")
    if not any(getattr(rule, kind, False) for kind in UNMASKED_SUMS):
        wired = ", ".join(sorted(n for n, r in STRATEGIES.items() if any(getattr(r, k, False) for k in UNMASKED_SUMS)))
        return (f"secure_aggregation: {algorithm} needs only sums, but sums the PS does not unmask yet (only the "
                f"sample-weighted and the plain mean of the updates are wired, with the sums of {wired}); "
                "docs/secure-aggregation.md")
    if any(getattr(rule, kind, False) for kind in ("from_weighted_mean", "sums_uniform")) and (
            refusal := mean_refusal(build_strategy(algorithm, dict(params or {})))):
        return f"secure_aggregation: {refusal}"
    return _sites_problem(n_sites) or _ring_problem(sa, n_sites)


def _sites_problem(n_sites: int) -> str | None:
    if n_sites < MIN_SITES:
        return (f"secure_aggregation needs at least {MIN_SITES} sites (got {n_sites}): with two, each learns the "
                "other's update from the sum")
    return None


def _ring_problem(sa: SecureAggregationConfig, n_sites: int) -> str | None:
    try:
        sa.fixed_point(n_sites)
    except ConfigError as exc:
        return str(exc)
    return None


class DaemonConfig(BaseModel):
    """Everything the PS needs; relative paths are resolved against the config file's folder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(pattern=ID_PATTERN, description="the run's id: every topic lives under fedmqtt/v1/<run_id>/ "
                        "and must match the broker's ACL")
    algorithm: str = Field(default="fedavg", description="the federated strategy (`fedmqtt algorithms` lists them; "
                           "docs/algorithms.md)")
    hyper: dict[str, HyperValue] = Field(default_factory=dict, description="the algorithm's hyper-parameters "
                                         "(numbers, or a word where the rule takes a choice, e.g. FedFBN's "
                                         "partial_labels = \"masked_loss\")")
    rounds: int = Field(default=20, ge=1, le=100_000, description="training rounds before the final evaluation")
    sites: tuple[str, ...] = Field(min_length=1, description="site ids allowed to take part")
    min_sites: int | None = Field(default=None, ge=1, description="sites online before round 1 (default: all)")
    quorum: int = Field(default=1, ge=1, description="updates needed to close a round at its deadline")
    selection: Literal["all", "fraction", "recruited"] = Field(
        default="all", description="all online sites; a seeded fraction per round; or the recruited set")
    fraction: float | None = Field(default=None, gt=0, le=1, description="share of the pool drawn each round")
    feature_statistics: Literal["site", "federated"] = Field(
        default="site", description="\"site\": every site standardises its inputs with its own training "
        "statistics; \"federated\": before round 1 the PS waits for every online site's feature summary, "
        "combines them and publishes the federation's statistics on ps/features, which every site uses")
    evaluation: Literal["selected", "all"] = Field(
        default="selected", description="which sites validate each round's model for the best round "
        "(docs/algorithms.md 17.1): \"selected\", the round's selected sites (they validate the model they "
        "receive); \"all\", every configured site, selected or not, recruited or not (Flower's "
        "fraction_evaluate = 1): each site not selected to train gets the round's validation task (an eval_task "
        "tagged \"round\", val split) and no round closes before every site not seen offline has answered")
    recruitment: RecruitmentConfig = Field(default=RecruitmentConfig(), description="recruitment weights and "
                                           "threshold, used with selection = \"recruited\"")
    round_timeout_s: float = Field(default=300.0, gt=0, description="a round's deadline: then it closes if the "
                                   "quorum is met, else the deadline is extended and the missing sites named")
    # Nothing arrived for the open round for this long: re-publish its model and the missing sites' tasks (a
    # broker that lost retained messages, a lost uplink), and say so in ps/status. 0 turns it off.
    stall_s: float = Field(default=120.0, ge=0, allow_inf_nan=False, description="nothing arrived for the open "
                           "round for this long: re-publish its model and the missing sites' tasks (0: never)")
    seed: int = Field(default=0, description="seeds the initial model, the per-round draw of sites and "
                      "local training (every task carries it in place of train.seed)")
    selection_metric: str = Field(default="auroc", max_length=128,  # a metric name on the wire is at most 128
                                  description="validation metric of the best round (docs/algorithms.md 17.1); "
                                  "loss, mae, mape, mse and msle are minimised, the rest maximised")
    out_dir: Path = Field(default=Path("runs/ps"), description="where checkpoints, logs and the run report go")
    keep_checkpoints: int = Field(default=3, ge=1, description="checkpoints kept on disk (the newest ones)")
    upload_turns: int = Field(default=2, ge=1, le=1024, description="large (chunked) updates the sites may put on "
                              "the broker at once; the broker holds the model plus at most this many updates")
    upload_turn_bytes: int = Field(default=256 * 2**20, ge=1, description="bytes the updates holding upload turns "
                                   "may declare in all before no further turn is granted (one always is): with a "
                                   "large model one update at a time is at the broker beside it")
    model: ModelSpec = Field(description="the model every site trains")
    train: TrainSettings = Field(default=TrainSettings(), description="local-training settings sent with each "
                                 "task")
    credentials: Path = Field(description="TOML file with a [broker] table (host, port, username, password)")
    pretrained: Path | None = Field(default=None, description="safetensors model for AdaFed's statistics")
    init_model: InitModelConfig | None = Field(default=None, description="start round 1 from a pretrained model "
                                               "instead of the seeded initialisation (any rule); unset: seeded")
    metrics: MetricsConfig = Field(default=MetricsConfig(), description="the Prometheus endpoint "
                                   "(docs/monitoring.md); off unless `port` is set")
    secure_aggregation: SecureAggregationConfig = Field(
        default=SecureAggregationConfig(), description="SecAgg+ (docs/secure-aggregation.md): the PS learns only the "
        "sum of the updates; off unless `enabled`")

    @model_validator(mode="after")
    def _check(self) -> DaemonConfig:
        for site in self.sites:
            if not re.fullmatch(ID_PATTERN, site):
                raise ValueError(f"site id {site!r} must match {ID_PATTERN}")
        if len(set(self.sites)) != len(self.sites):
            raise ValueError("sites: duplicate site id")
        if self.algorithm not in STRATEGIES:
            raise ValueError(f"algorithm {self.algorithm!r} unknown; available: {', '.join(sorted(STRATEGIES))}")
        build_strategy(self.algorithm, self.strategy_params())  # a bad hyper-parameter fails here, before start
        if self.algorithm in NEEDS_PRETRAINED and self.pretrained is None:
            raise ValueError(f"{self.algorithm} computes its similarity matrix with a pretrained model: set "
                             "`pretrained` to a safetensors file of the same model (f-adafed needs none)")
        if self.algorithm in SGD_ONLY and self.train.optimizer != "sgd":
            raise ValueError(f"{self.algorithm} requires train.optimizer = \"sgd\" ({SGD_ONLY[self.algorithm]}); "
                             f"got {self.train.optimizer!r}")
        if self.min_sites is not None and self.min_sites > len(self.sites):
            raise ValueError(f"min_sites {self.min_sites} > number of sites {len(self.sites)}")
        if self.selection == "fraction" and self.fraction is None:
            raise ValueError("selection = \"fraction\" needs `fraction` (e.g. 0.1)")
        if self.quorum > len(self.sites):
            raise ValueError(f"quorum {self.quorum} > number of sites {len(self.sites)}")
        stray = sorted(set(self.train.hyper) - set(LOCAL_OPTIMISER_KEYS))
        if stray:
            raise ValueError(f"train.hyper may hold only {', '.join(sorted(LOCAL_OPTIMISER_KEYS))}; move "
                             f"{', '.join(stray)} to `hyper`")
        local = {**self.train.hyper, **self.hyper}
        try:
            check_local_optimiser(local, self.train.optimizer)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if problem := optimiser_problem(self.algorithm, self.train.optimizer, local):
            raise ValueError(problem)
        if self.train.dp is not None and (problem := record_dp_problem(self.algorithm, local)):
            raise ValueError(f"train.dp: {problem}")
        if problem := secure_aggregation_problem(self.algorithm, self.secure_aggregation, len(self.sites),
                                                 self.strategy_params()):
            raise ValueError(problem)
        if self.evaluation == "all" and self.secure_aggregation.enabled:
            raise ValueError("evaluation = \"all\" is not built for secure aggregation (its rounds close with the "
                             "secure sum): set evaluation = \"selected\"")
        if self.selection == "fraction" and self.fraction is not None:
            drawn = min_drawn(len(self.sites), self.fraction)
            if drawn < self.quorum:
                raise ValueError(f"selection = \"fraction\" with fraction {self.fraction} draws {drawn} of "
                                 f"{len(self.sites)} sites per round, fewer than quorum {self.quorum}: no round could "
                                 f"close. Raise `fraction` or lower `quorum`")
        return self

    def record_dp(self) -> RecordDP | None:
        """train.dp as the tasks carry it: a target epsilon is spread over this run's `rounds` unless it says
        over how many."""
        dp = self.train.dp
        if dp is None or dp.target_epsilon is None or dp.planned_rounds is not None:
            return dp
        return dp.model_copy(update={"planned_rounds": self.rounds})

    def strategy_params(self) -> dict[str, HyperValue]:
        """`hyper`, plus the run length for f-AdaFed's default warm-up (floor(T/2))."""
        if self.algorithm == "f-adafed":
            return {"total_rounds": self.rounds, **self.hyper}
        return dict(self.hyper)

    @property
    def sorted_sites(self) -> tuple[str, ...]:
        return tuple(sorted(self.sites))

    @property
    def start_sites(self) -> int:
        return self.min_sites or len(self.sites)

    def config_hash(self) -> str:
        """What must not change across `--resume` (the broker, credentials and out_dir may)."""
        keep = self.model_dump(mode="json", exclude={"credentials", "out_dir", "round_timeout_s", "keep_checkpoints",
                                                      "pretrained", "upload_turns", "upload_turn_bytes",
                                                      "metrics", "init_model"})
        if self.init_model is not None:  # the file may move; how it was loaded may not (unset: hashes as before)
            keep["init_model"] = {"tensors": self.init_model.tensors}
        if keep.get("feature_statistics") == "site":  # the default: checkpoints from before the option still match
            del keep["feature_statistics"]
        if keep.get("evaluation") == "selected":  # the default, likewise
            del keep["evaluation"]
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]

    def broker_settings(self) -> BrokerSettings:
        return load_credentials(self.credentials)

    def identity(self) -> Identity:
        """The PS's signing key and key list (the credentials' [signing] table); the newest key list it accepts
        is kept in out_dir, so a restart never falls back to an older one."""
        return load_identity(self.credentials, run_id=self.run_id, store=self.out_dir / KEY_LIST_FILE)


def min_drawn(n_sites: int, fraction: float) -> int:
    """How many sites a per-round draw of `fraction` picks from `n_sites` (fedmqtt.recruitment.sample_sites)."""
    from fedmqtt.recruitment import sample_sites

    return len(sample_sites([f"s{i}" for i in range(n_sites)], fraction, seed=0, round_no=1))


def load_daemon_config(path: Path, *, algorithm: str | None = None) -> DaemonConfig:
    """The PS config file; `algorithm` (the CLI's --algorithm) overrides its algorithm key."""
    if algorithm is not None:
        raw = load_toml(path, _Raw)
        cfg = validate_config({**raw.model_dump(), "algorithm": algorithm}, DaemonConfig, source=str(path))
    else:
        cfg = load_toml(path, DaemonConfig)
    base = Path(path).resolve().parent
    return cfg.model_copy(
        update={
            "out_dir": cfg.out_dir if cfg.out_dir.is_absolute() else base / cfg.out_dir,
            "credentials": cfg.credentials if cfg.credentials.is_absolute() else base / cfg.credentials,
            "pretrained": (cfg.pretrained if cfg.pretrained is None or cfg.pretrained.is_absolute()
                           else base / cfg.pretrained),
            "metrics": cfg.metrics.resolved(base),
            "init_model": None if cfg.init_model is None else cfg.init_model.resolved(base),
        }
    )
