"""DataSpec: where a site's data is, its format, and (in simulations) which part of a partition is its."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedmqtt.data.tables import FeatureSpec

DataFormat = Literal["heart_disease", "table", "medmnist", "wfdb", "physionet2012"]


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HeartDiseaseOptions(_Options):
    """`path` is one processed UCI file (e.g. processed.cleveland.data); no options."""


class TableOptions(_Options):
    """`path` is a CSV (or Parquet, with pyarrow) file."""

    spec: str | FeatureSpec = Field(description="a named feature spec ('stroke') or an inline one")


class MedmnistOptions(_Options):
    """`path` is a MedMNIST .npz; the chosen official splits are pooled, then split locally."""

    splits: tuple[Literal["train", "val", "test"], ...] = Field(
        default=("train", "val", "test"), min_length=1)


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


OPTIONS: dict[str, type[_Options]] = {
    "heart_disease": HeartDiseaseOptions, "table": TableOptions, "medmnist": MedmnistOptions,
    "wfdb": WfdbOptions, "physionet2012": Physionet2012Options,
}


class DataSpec(BaseModel):
    """A site's data: format, location and format-specific options, validated when the config is read.

    With `partition` (a manifest written by `fedmqtt partition`) the file at `path` is the pooled dataset
    and the site keeps only the items the manifest lists under `site`; the manifest's source must match.
    The site then splits its own items into train/val/test (`fractions`, seeded by `split_seed`) and
    normalises with its own train statistics.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: DataFormat = "heart_disease"
    path: Path = Field(description="the site's own data file or folder; nothing else is read")
    options: dict[str, Any] = Field(default_factory=dict, description="format-specific, see OPTIONS")
    partition: Path | None = Field(default=None, description="simulation: a partition manifest")
    site: str | None = Field(default=None, description="which part of the manifest is this site's")
    split_seed: int = 0
    fractions: tuple[float, float, float] = (0.6, 0.2, 0.2)

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        if abs(sum(self.fractions) - 1.0) > 1e-6 or min(self.fractions) <= 0:
            raise ValueError(f"fractions {self.fractions} must be positive and sum to 1 (train, val, test)")
        if (self.partition is None) != (self.site is None):
            raise ValueError("partition and site go together: the manifest and which of its sites this is")
        self.parsed_options()  # fail when the config is read, not when training starts
        return self

    def parsed_options(self) -> Any:
        """`options` validated by the format's options model (e.g. `WfdbOptions`)."""
        return OPTIONS[self.format].model_validate(self.options)

    def resolved(self, base: Path) -> DataSpec:
        """Relative paths (path, partition, options outcomes/cache_dir) made absolute against `base`."""

        def fix(p: Any) -> Any:
            return p if p is None or Path(p).is_absolute() else str(Path(base) / p)

        options = dict(self.options)
        for key in ("outcomes", "cache_dir"):
            if options.get(key) is not None:
                options[key] = fix(options[key])
        return self.model_copy(update={
            "path": Path(fix(self.path)), "options": options,
            "partition": None if self.partition is None else Path(fix(self.partition)),
        })
