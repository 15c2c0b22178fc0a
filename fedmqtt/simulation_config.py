"""SimulationConfig: a whole federation (the PS settings and every site's data) described in one file.

Its own module so that both ways of running it, the federation (fedmqtt.simulation) and the pooled
baseline (fedmqtt.central), import the config without importing each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedmqtt.config_io import read_toml, validate_config
from fedmqtt.data.heart_disease import SITES, bundled_path
from fedmqtt.data.spec import DataSpec, is_spec_file, load_data_spec
from fedmqtt.errors import ConfigError
from fedmqtt.strategies.params import LOCAL_OPTIMISER_KEYS, HyperValue, check_local_optimiser
from fedmqtt.training.client_rules import SGD_ONLY, optimiser_problem
from ps_daemon.config import NEEDS_PRETRAINED, DaemonConfig, InitModelConfig
from schemas.base import ID_PATTERN
from schemas.messages import ModelSpec, TrainSettings
from site_agent.config import SiteConfig

IN_PROCESS = Path("(in-process)")
DEFAULT_MODEL = ModelSpec(name="mlp", args={"in_features": 15, "hidden": [32, 32], "norm": "none", "dropout": 0.3})
DEFAULT_TRAIN = TrainSettings(epochs=2, batch_size=32, lr=0.001, optimizer="adam")
# For the algorithms whose client rule is defined for plain SGD only (SCAFFOLD option II, FedNova's
# ||a_i||_1): what a run gets when its train settings were left at DEFAULT_TRAIN. lr 0.05: plain SGD
# needs a larger step than Adam's 0.001 to move the bundled MLP within a few rounds.
SGD_TRAIN = TrainSettings(epochs=2, batch_size=32, lr=0.05, optimizer="sgd")
# AdaFed / d-AdaFed need a pretrained model; a simulation makes one from this share of the pooled
# training rows when none is given (as Chen et al. do).
DEFAULT_PRETRAIN_FRACTION = 0.2


def bundled_sites() -> dict[str, DataSpec]:
    """The four UCI heart-disease hospitals shipped with the package (natural split)."""
    return {site: DataSpec(format="heart_disease", path=bundled_path(site)) for site in SITES}


class SimulationConfig(BaseModel):
    """A federation described in one file: the PS settings plus each site's data."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(default="sim", pattern=ID_PATTERN, description="run id: a-z, 0-9 and '-'")
    algorithm: str = Field(default="fedavg", description="a strategy of `fedmqtt algorithms`, or \"central\" "
                           "(one model on the pooled training rows: the baseline no deployment can run)")
    hyper: dict[str, HyperValue] = Field(default_factory=dict, description="the algorithm's hyper-parameters "
                                    "(`fedmqtt algorithms NAME` lists them with their defaults)")
    rounds: int = Field(default=20, ge=1, description="federated rounds")
    seed: int = Field(default=0, description="run seed: model initialisation, local shuffling, sampling")
    selection_metric: str = Field(default="auroc", description="validation metric that picks the best round "
                                  "(docs/algorithms.md 17.1); loss-type metrics are minimised")
    out_dir: Path = Field(default=Path("runs/sim"), description="report.json, models and checkpoints; "
                          "relative to the config file's folder")
    model: ModelSpec = Field(default=DEFAULT_MODEL, description="model name and arguments (default: the "
                             "bundled heart-disease MLP)")
    train: TrainSettings = Field(default=DEFAULT_TRAIN, description="local training settings sent with each "
                                 "task (epochs, batch_size, lr, optimizer...)")
    sites: dict[str, DataSpec] = Field(default_factory=bundled_sites, description="site id -> its data: a "
                                       "data spec table, or the path of a TOML file holding one (default: "
                                       "the four bundled heart-disease hospitals)")
    share_label_histograms: bool = Field(default=True, description="let sites report their label counts "
                                         "(recruitment and FedDkw need them; in a simulation the researcher "
                                         "holds every site's data anyway)")
    selection: str = Field(default="all", description="all | fraction | recruited: which sites each round "
                           "asks (validated as the PS config validates it)")
    fraction: float | None = Field(default=None, description="selection = \"fraction\": share of the sites "
                                   "drawn each round")
    evaluation: Literal["selected", "all"] = Field(
        default="selected", description="which sites validate each round's model for the best round: the "
        "round's selected sites (selected), or every site, selected or not, recruited or not (all; Flower's "
        "fraction_evaluate = 1). Training selection is unchanged")
    recruitment: dict[str, float] = Field(default_factory=dict, description="selection = \"recruited\": "
                                          "gamma_dv, gamma_sa, gamma_th (docs/algorithms.md 15)")
    pretrained: Path | None = Field(default=None, description="AdaFed / d-AdaFed: a model (safetensors) "
                                    "trained outside the federation")
    init_model: InitModelConfig | None = Field(default=None, description="start round 1 from a pretrained "
                                               "model (any rule): [init_model] path, tensors (\"all\" or "
                                               "\"matching\"), max_bytes, as in the PS config")
    pretrain_fraction: float | None = Field(default=None, gt=0, le=1, description="simulation only: pretrain "
                                            "that model on this share of the pooled training rows (AdaFed "
                                            f"without `pretrained` gets {DEFAULT_PRETRAIN_FRACTION})")
    feature_statistics: Literal["site", "federated", "auto"] = Field(
        default="site", description="what tables and ICU stays are clipped, filled and standardised with: each "
        "site's own training statistics (site), the federation's, combined from every site's sums before round 1 "
        "(federated; docs/data-preparation.md), or the federation's when the smallest site has fewer than "
        "fedmqtt.data.feature_stats.SMALL_SITE_ROWS training rows (auto)")

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        """Defaults that depend on the algorithm (see `algorithm_defaults`)."""
        return algorithm_defaults(data) if isinstance(data, dict) else data

    def daemon_config(self) -> DaemonConfig:
        """The PS config this simulation runs with (validated: a bad algorithm or parameter fails here)."""
        stray = sorted(set(self.train.hyper) - set(LOCAL_OPTIMISER_KEYS))
        if stray:  # the algorithm's own keys belong in `hyper`, where its parameter check sees them
            raise ConfigError(f"simulation config: train.hyper may hold only {', '.join(LOCAL_OPTIMISER_KEYS)}; "
                              f"move {', '.join(stray)} to `hyper`")
        local = {**self.train.hyper, **self.hyper}  # as the PS merges them into each task
        try:
            check_local_optimiser(local, self.train.optimizer)
        except ConfigError as exc:
            raise ConfigError(f"simulation config: {exc}") from None
        if self.algorithm == "scaffold" and (problem := optimiser_problem(self.algorithm, "sgd", local)):
            raise ConfigError(f"simulation config: {problem}")
        if self.algorithm == "central":  # the pooled baseline has no PS; validate as FedAvg would
            return self.model_copy(update={"algorithm": "fedavg", "hyper": {}}).daemon_config()
        return validate_config({
            "run_id": self.run_id, "algorithm": self.algorithm, "rounds": self.rounds, "seed": self.seed,
            "sites": sorted(self.sites), "out_dir": self.out_dir, "model": self.model, "train": self.train,
            "credentials": IN_PROCESS, **({"hyper": self.hyper} if self.hyper else {}),
            "selection": self.selection, "fraction": self.fraction, "recruitment": self.recruitment,
            "selection_metric": self.selection_metric,
            **({"evaluation": self.evaluation} if self.evaluation != "selected" else {}),
            # pretrain_fraction: the model is pretrained when the run starts (placeholder for validation)
            "pretrained": self.pretrained or (Path("(pretrained at start)") if self.pretrain_fraction else None),
            "init_model": self.init_model,
        }, DaemonConfig, source="simulation config")

    def site_configs(self) -> list[SiteConfig]:
        return [SiteConfig(site_id=site, run_id=self.run_id, credentials=IN_PROCESS,
                           state_dir=self.out_dir / "state" / site, data=spec, device="cpu", threads=1,
                           share_label_histogram=self.share_label_histograms)
                for site, spec in sorted(self.sites.items())]


def algorithm_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (a SimulationConfig as a dict) with the defaults its algorithm needs to run at all.

    - SCAFFOLD and FedNova need plain SGD: train settings left at DEFAULT_TRAIN (or not given) become
      SGD_TRAIN. Train settings the user changed are kept, so a user's Adam is an error that names the
      fix (train.optimizer = "sgd"), never silently replaced.
    - AdaFed's statistics are BatchNorm's: the default model (no norm layers) gets norm = "bn".
    - AdaFed and d-AdaFed need a pretrained model: without `pretrained` or `pretrain_fraction` the
      simulation pretrains on DEFAULT_PRETRAIN_FRACTION of the pooled training rows.
    """
    algorithm = data.get("algorithm")
    out = dict(data)
    if algorithm in SGD_ONLY:
        train = out.get("train")
        given = TrainSettings.model_validate(train) if train is not None else DEFAULT_TRAIN
        if given == DEFAULT_TRAIN:
            out["train"] = SGD_TRAIN
    if algorithm == "adafed":
        model = out.get("model")
        if model is None or ModelSpec.model_validate(model) == DEFAULT_MODEL:
            out["model"] = DEFAULT_MODEL.model_copy(update={"args": {**DEFAULT_MODEL.args, "norm": "bn"}})
    if algorithm in NEEDS_PRETRAINED and out.get("pretrained") is None and out.get("pretrain_fraction") is None:
        out["pretrain_fraction"] = DEFAULT_PRETRAIN_FRACTION
    return out


def load_simulation_config(path: Path | None, **overrides: Any) -> SimulationConfig:
    """The config file with CLI overrides applied.

    Relative paths (out_dir, each site's data, a site given as the path of a data-spec file) are
    resolved against the config file's folder; paths inside a data-spec file against that file's.
    """
    if path is None:
        base = SimulationConfig()
    else:
        path = Path(path)
        raw = read_toml(path)
        root = path.resolve().parent
        raw = expand_site_files(raw, root, source=str(path))
        base = validate_config(raw, SimulationConfig, source=str(path))
        sites = {s: d.resolved(root) for s, d in base.sites.items()}
        out = base.out_dir if base.out_dir.is_absolute() else root / base.out_dir
        init = None if base.init_model is None else base.init_model.resolved(root)
        base = base.model_copy(update={"sites": sites, "out_dir": out, "init_model": init})
    updates = {k: v for k, v in overrides.items() if v is not None}
    cfg = SimulationConfig.model_validate({**base.model_dump(), **updates})
    for site, spec in cfg.sites.items():  # a feature-spec file that is missing or invalid fails now, by name
        try:
            spec.parsed_options(load_files=True)
        except ConfigError as exc:
            raise ConfigError(f"site {site!r}: {exc}") from None
    return cfg


def expand_site_files(raw: dict[str, Any], root: Path, *, source: str) -> dict[str, Any]:
    """`raw` with every site given as a data-spec file path (`a = "sites/a.toml"`) replaced by that spec."""
    sites = raw.get("sites")
    if not isinstance(sites, dict):
        return raw
    expanded = {}
    for site, value in sites.items():
        if isinstance(value, str):
            if not is_spec_file(value):
                raise ConfigError(f"{source}: sites.{site}: {value!r} is neither a data-spec table nor the path "
                                  "of a .toml file holding one")
            file = Path(value) if Path(value).is_absolute() else root / value
            value = load_data_spec(file).model_dump(mode="json", exclude_defaults=True)
        expanded[site] = value
    return {**raw, "sites": expanded}
