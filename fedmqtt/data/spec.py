"""DataSpec: where a site's data is, its format, and (in simulations) which part of a partition is its."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package (the `tomli` dependency)
    import tomli as tomllib

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from fedmqtt.data.physionet2012 import RANGED_COLUMNS
from fedmqtt.data.plausible import PHYSIONET2012_RANGES, check_ranges
from fedmqtt.data.tables import NAMED_SPECS, FeatureSpec
from fedmqtt.errors import ConfigError

if TYPE_CHECKING:
    from fedmqtt.data.partitioners import PartitionSpec

M = TypeVar("M", bound=BaseModel)
SPEC_FILE_SUFFIXES = (".toml", ".json")

DataFormat = Literal["heart_disease", "table", "medmnist", "wfdb", "physionet2012"]


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HeartDiseaseOptions(_Options):
    """`path` is one processed UCI file (e.g. processed.cleveland.data); no options."""


class TableOptions(_Options):
    """`path` is a CSV (or Parquet, with pyarrow) file."""

    spec: str | FeatureSpec = Field(description="the feature spec: a name ('stroke'), an inline table, or the "
                                    "path of a .toml/.json file holding one")

    @field_validator("spec", mode="before")
    @classmethod
    def _named_or_file(cls, value: Any, info: ValidationInfo) -> Any:
        """A name must be known; a file is read unless the context says `load_files: False`.

        The file is read late on purpose: a config names it relative to its own folder, and the path
        is only absolute after DataSpec.resolved().
        """
        if not isinstance(value, (str, Path)) or str(value) in NAMED_SPECS:
            return value
        if not is_spec_file(value):
            raise ValueError(f"unknown feature spec {str(value)!r}: give a name ({', '.join(NAMED_SPECS)}), an "
                             "inline table, or the path of a .toml/.json file")
        if info.context is not None and not info.context.get("load_files", True):
            return str(value)
        return load_feature_spec(Path(value))


class MedmnistOptions(_Options):
    """`path` is a MedMNIST .npz; the chosen official splits are pooled, then split locally."""

    splits: tuple[Literal["train", "val", "test"], ...] = Field(
        default=("train", "val", "test"), min_length=1)
    targets: Literal["class", "one_vs_rest"] = Field(default="class", description="\"class\": the file's labels "
                                                     "as they are; \"one_vs_rest\": a single-label file's class "
                                                     "k becomes k binary labels, a multi-label task, so a partition's "
                                                     "labels_per_site can leave some unannotated (partial labels)")
    channels: Literal[1, 3] | None = Field(default=None, description="colour channels the model sees: 3 repeats "
                                           "a grey image, 1 turns a colour image grey (ITU-R BT.601 luma "
                                           "weights); unset: as stored. For a model pretrained on images with "
                                           "the other number of channels")


class WfdbOptions(_Options):
    """`path` is a folder of WFDB records (.hea + .mat/.dat)."""

    labels: Literal["cinc2021"] | list[str] = Field(default="cinc2021", description="'cinc2021' (26 scored "
                                                    "classes) or SNOMED-CT codes, 'a|b' for equivalent codes")
    fs: int = Field(default=500, gt=0, description="resample every record to this rate (Hz)")
    length: int = Field(default=5000, gt=0, description="samples kept per lead (crop or zero-pad)")


class Physionet2012Options(_Options):
    """`path` is a `set-a`-style folder of per-stay files."""

    target: Literal["mortality", "los"] = "mortality"
    outcomes: Path | None = Field(default=None, description="default: Outcomes-<x>.txt beside set-<x>/")
    masks: bool = Field(default=False, description="append 37 observed-this-hour mask channels")
    cache_dir: Path | None = Field(default=None, description="keep a parsed .npz here (outside the dataset)")
    limit: int | None = Field(default=None, ge=1, description="only the first N stays by file name")
    ranges: dict[str, tuple[float, float]] = Field(
        default_factory=lambda: dict(PHYSIONET2012_RANGES), description="variable -> [low, high] in the "
        "challenge's units; a measurement outside is set to missing and counted in the site's notes. "
        "Default: wide physiological ranges (fedmqtt.data.plausible); {} turns the check off")
    log_target: bool | None = Field(default=None, description="los: train on log1p(days), predict expm1 "
                                    "(metrics in days); default on for los, off for mortality")

    @model_validator(mode="after")
    def _check(self) -> Physionet2012Options:
        check_ranges(self.ranges, RANGED_COLUMNS, what="PhysioNet 2012 variables")
        if self.log_target and self.target != "los":
            raise ValueError("log_target is for the regression target los, not mortality")
        return self

    @property
    def log_scale(self) -> bool:
        """Whether the length of stay is learnt as log1p(days): `log_target`, by default on for los."""
        return self.target == "los" and self.log_target is not False


OPTIONS: dict[str, type[_Options]] = {
    "heart_disease": HeartDiseaseOptions, "table": TableOptions, "medmnist": MedmnistOptions,
    "wfdb": WfdbOptions, "physionet2012": Physionet2012Options,
}


class DataSpec(BaseModel):
    """A site's data: format, location and format-specific options, validated when the config is read.

    With `partition` (a manifest written by `fedmqtt partition`) the file at `path` is the pooled dataset
    and the site keeps only the items the manifest lists under `site`; the manifest's source must match.
    The site then splits its own items into train/val/test (`fractions`, seeded by `split_seed`) and
    normalises with its own train statistics, or with the federation's (`statistics`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: DataFormat = "heart_disease"
    path: Path = Field(description="the site's own data file or folder; nothing else is read")
    options: dict[str, Any] = Field(default_factory=dict, description="format-specific, see OPTIONS")
    partition: Path | None = Field(default=None, description="simulation: a partition manifest")
    site: str | None = Field(default=None, description="which part of the manifest is this site's")
    split_seed: int = 0
    fractions: tuple[float, float, float] = (0.6, 0.2, 0.2)
    statistics: Path | None = Field(default=None, description="a feature_statistics file (the federation's "
                                    "statistics, fedmqtt.data.feature_stats): tables and ICU stays are clipped, "
                                    "filled and standardised with it instead of this site's own train statistics")

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        if abs(sum(self.fractions) - 1.0) > 1e-6 or min(self.fractions) <= 0:
            raise ValueError(f"fractions {self.fractions} must be positive and sum to 1 (train, val, test)")
        if (self.partition is None) != (self.site is None):
            raise ValueError("partition and site go together: the manifest and which of its sites this is")
        self.parsed_options(load_files=False)  # fail when the config is read, not when training starts
        return self

    def parsed_options(self, *, load_files: bool = True) -> Any:
        """`options` validated by the format's options model (e.g. `WfdbOptions`); a feature spec given as a
        file path is read (ConfigError when missing or invalid) unless `load_files` is False."""
        return OPTIONS[self.format].model_validate(self.options, context={"load_files": load_files})

    def resolved(self, base: Path) -> DataSpec:
        """Relative paths (path, partition, options outcomes/cache_dir) made absolute against `base`."""

        def fix(p: Any) -> Any:
            return p if p is None or Path(p).is_absolute() else str(Path(base) / p)

        options = dict(self.options)
        for key in ("outcomes", "cache_dir"):
            if options.get(key) is not None:
                options[key] = fix(options[key])
        if self.format == "table" and is_spec_file(options.get("spec")):
            options["spec"] = fix(options["spec"])
        return self.model_copy(update={
            "path": Path(fix(self.path)), "options": options,
            "partition": None if self.partition is None else Path(fix(self.partition)),
            "statistics": None if self.statistics is None else Path(fix(self.statistics)),
        })


def is_spec_file(value: Any) -> bool:
    """Whether `value` names a spec file (.toml or .json) rather than a named spec or an inline table."""
    return isinstance(value, (str, Path)) and Path(value).suffix.lower() in SPEC_FILE_SUFFIXES


def read_spec_file(path: Path, model: type[M], *, table: str | None = None) -> M:
    """A .toml or .json file as `model`: its top level, or its `table` when it has one.

    Raises:
        ConfigError: the file is missing, is not valid TOML/JSON, or does not validate; the message
            names the file and each wrong field.
    """
    path = Path(path)
    what = model.__name__
    if not path.is_file():
        raise ConfigError(f"{path}: {what} file not found")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.').upper()}: {exc}") from None
    if table is not None and isinstance(data.get(table), dict):
        data = data[table]
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{path}: invalid {what}: {fields}") from None


def load_feature_spec(path: Path) -> FeatureSpec:
    """A table's feature spec from a file (label, task, classes, numeric, binary, categorical, drop...)."""
    return read_spec_file(path, FeatureSpec)


def load_data_spec(path: Path) -> DataSpec:
    """A DataSpec from a file (its keys at the top level, or in a [data] table as in a site config), with
    relative paths resolved against the file's folder."""
    return read_spec_file(path, DataSpec, table="data").resolved(Path(path).resolve().parent)


def load_partition_spec(path: Path) -> PartitionSpec:
    """A partition spec from a file: kind, n_sites, alpha, column, cap, seed (docs/algorithms.md 16)."""
    from fedmqtt.data.partitioners import PartitionSpec

    return read_spec_file(path, PartitionSpec, table="partition")
