"""CSV/Parquet tables read through a fixed feature spec (numeric, binary and one-hot columns)."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedmqtt.data.base import TaskInfo, parse_number
from fedmqtt.data.plausible import check_ranges
from fedmqtt.errors import DataError


class BinaryColumn(BaseModel):
    """A two-valued column: `true` -> 1, `false` -> 0, a missing token -> NaN, anything else an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    true: str
    false: str


class CategoricalColumn(BaseModel):
    """One-hot over a FIXED vocabulary; `missing` values (e.g. "Unknown") make every one-hot column NaN."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    values: tuple[str, ...] = Field(min_length=1)
    missing: tuple[str, ...] = ()


class FeatureSpec(BaseModel):
    """Which columns a table has and how each becomes features; identical at every site by construction."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str
    task: Literal["binary", "multiclass", "regression"] = "binary"
    classes: tuple[str, ...] = Field(default=("0", "1"), description="label values in class order (binary: "
                                     "negative, positive); unused for regression")
    numeric: tuple[str, ...] = ()
    binary: dict[str, BinaryColumn] = Field(default_factory=dict)
    categorical: dict[str, CategoricalColumn] = Field(default_factory=dict)
    drop: tuple[str, ...] = Field(default=(), description="columns read but not used (ids, a site column)")
    missing: tuple[str, ...] = Field(default=("", "NA", "N/A", "NaN", "nan", "?"),
                                     description="cell values meaning 'not recorded' in any column")
    ranges: dict[str, tuple[float, float]] = Field(
        default_factory=dict, description="numeric column -> [low, high]: a value outside is a unit error or "
        "impossible and becomes missing (counted per column in the site's notes)")
    log_target: bool = Field(default=False, description="regression: train on log1p(label) and predict "
                             "expm1 of the output (for skewed targets such as lengths of stay); metrics "
                             "stay on the label's own scale")

    @model_validator(mode="after")
    def _check(self) -> FeatureSpec:
        names = [self.label, *self.numeric, *self.binary, *self.categorical, *self.drop]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"columns listed twice in the feature spec: {dupes}")
        if self.task == "binary" and len(self.classes) != 2:
            raise ValueError(f"a binary label needs exactly 2 classes, got {self.classes}")
        if self.task == "multiclass" and len(self.classes) < 2:
            raise ValueError(f"a multiclass label needs at least 2 classes, got {self.classes}")
        check_ranges(self.ranges, self.numeric, what="numeric columns")
        if self.log_target and self.task != "regression":
            raise ValueError(f"log_target is for regression labels; this label is {self.task}")
        return self

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column the file must have."""
        return (self.label, *self.numeric, *self.binary, *self.categorical, *self.drop)

    @property
    def feature_names(self) -> tuple[str, ...]:
        one_hot = (f"{name}_{v}" for name, col in self.categorical.items() for v in col.values)
        return (*self.numeric, *self.binary, *one_hot)

    def task_info(self) -> TaskInfo:
        if self.task == "regression":
            return TaskInfo("regression", 1, (self.label,), target="log1p" if self.log_target else "identity")
        return TaskInfo(self.task, 1 if self.task == "binary" else len(self.classes), self.classes)


# Kaggle stroke prediction (../shared/datasets/stroke): vocabularies from the dataset's documentation, so
# each site builds the same one-hot columns. bmi "N/A" is missing; smoking_status "Unknown" = not recorded.
STROKE_SPEC = FeatureSpec(
    label="stroke",
    numeric=("age", "avg_glucose_level", "bmi"),
    binary={
        "hypertension": BinaryColumn(true="1", false="0"),
        "heart_disease": BinaryColumn(true="1", false="0"),
        "ever_married": BinaryColumn(true="Yes", false="No"),
        "Residence_type": BinaryColumn(true="Urban", false="Rural"),
    },
    categorical={
        "gender": CategoricalColumn(values=("Female", "Male", "Other")),
        "work_type": CategoricalColumn(
            values=("Private", "Self-employed", "Govt_job", "children", "Never_worked")),
        "smoking_status": CategoricalColumn(values=("never smoked", "formerly smoked", "smokes"),
                                            missing=("Unknown",)),
    },
    drop=("id",),
)
NAMED_SPECS: dict[str, FeatureSpec] = {"stroke": STROKE_SPEC}


def resolve_spec(spec: str | FeatureSpec | dict[str, object]) -> FeatureSpec:
    """A named spec ("stroke"), an inline spec dict (e.g. from TOML), or a FeatureSpec."""
    if isinstance(spec, FeatureSpec):
        return spec
    if isinstance(spec, str):
        if spec not in NAMED_SPECS:
            raise DataError(f"unknown table spec {spec!r}; named specs: {', '.join(NAMED_SPECS)}")
        return NAMED_SPECS[spec]
    return FeatureSpec.model_validate(spec)


def load_table(path: Path, spec: FeatureSpec) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Read a CSV (or Parquet) table through `spec`.

    Returns:
        `(x, y, feature_names)`: x float64 `(n, f)` with NaN where missing (all one-hot columns of a missing
        categorical are NaN); y int64 class indices, or float32 for regression (NaN where missing).

    Raises:
        DataError: unreadable file, a spec column missing or an undeclared one present, a bad number, an
        unknown category or label; the message names the file, the line (row) and the column.
    """
    path = Path(path)
    header, rows = _open(path)
    _check_header(path, header, spec)
    col = {name: i for i, name in enumerate(header)}
    x_rows: list[list[float]] = []
    labels: list[float] = []
    for where, cells in rows:
        if len(cells) != len(header):
            raise DataError(f"{path}: {where}: expected {len(header)} fields, found {len(cells)}")
        x_rows.append(_encode(path, where, cells, col, spec))
        labels.append(_label(path, where, cells[col[spec.label]].strip(), spec))
    if not x_rows:
        raise DataError(f"{path}: no data rows")
    dtype = np.float32 if spec.task == "regression" else np.int64
    x = np.asarray(x_rows, dtype=np.float64).reshape(len(x_rows), len(spec.feature_names))
    return x, np.asarray(labels).astype(dtype), spec.feature_names


def read_columns(path: Path, columns: Sequence[str]) -> dict[str, np.ndarray]:
    """Raw cell strings of some columns, row-aligned with `load_table` (e.g. a site column to split on)."""
    header, rows = _open(Path(path))
    missing = [c for c in columns if c not in header]
    if missing:
        raise DataError(f"{path}: no column {missing[0]!r}; columns: {', '.join(header)}")
    idx = [header.index(c) for c in columns]
    cells = [[r[i].strip() if i < len(r) else "" for i in idx] for _, r in rows]
    return {c: np.asarray([row[k] for row in cells], dtype=object) for k, c in enumerate(columns)}


def _open(path: Path) -> tuple[list[str], Iterator[tuple[str, list[str]]]]:
    if path.suffix.lower() in (".parquet", ".pq"):
        return _open_parquet(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is common in exported CSVs
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read table: {exc}") from exc
    reader = csv.reader(text.splitlines())
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise DataError(f"{path}: empty file (no header line)") from None
    except csv.Error as exc:
        raise DataError(f"{path}: line 1: malformed CSV: {exc}") from exc
    return header, _csv_rows(path, reader)


def _csv_rows(path: Path, reader: Any) -> Iterator[tuple[str, list[str]]]:
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise DataError(f"{path}: line {reader.line_num}: malformed CSV: {exc}") from exc
        if cells:  # skip blank lines
            yield f"line {reader.line_num}", cells


def _open_parquet(path: Path) -> tuple[list[str], Iterator[tuple[str, list[str]]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), which is not "
                        "installed; or convert the table to CSV") from None
    try:
        data = pq.read_table(path).to_pydict()
    except Exception as exc:  # pyarrow raises several unrelated types for a damaged file
        raise DataError(f"{path}: cannot read Parquet table: {exc}") from exc
    header = list(data)
    n = len(next(iter(data.values()), []))
    rows = ((f"row {i + 1}", [_cell(data[h][i]) for h in header]) for i in range(n))
    return header, rows


def _cell(value: object) -> str:
    """A Parquet value as the text a CSV would hold (None/NaN -> empty, 1.0 -> "1")."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _check_header(path: Path, header: list[str], spec: FeatureSpec) -> None:
    for name in spec.columns:
        if name not in header:
            raise DataError(f"{path}: column {name!r} of the feature spec is missing; file columns: {header}")
    extra = [h for h in header if h not in spec.columns]
    if extra:
        raise DataError(f"{path}: column {extra[0]!r} is not in the feature spec (list it under `drop` "
                        "to ignore it)")
    if len(set(header)) != len(header):
        raise DataError(f"{path}: duplicate column names in the header: {header}")


def _encode(path: Path, where: str, cells: list[str], col: dict[str, int], spec: FeatureSpec) -> list[float]:
    out: list[float] = []
    for name in spec.numeric:
        raw = cells[col[name]].strip()
        if raw in spec.missing:
            out.append(math.nan)
            continue
        out.append(parse_number(raw, where=f"{path}: {where}, column {name!r}"))
    for name, b in spec.binary.items():
        raw = cells[col[name]].strip()
        if raw not in (b.true, b.false) and raw not in spec.missing:
            raise DataError(f"{path}: {where}, column {name!r}: unknown value {raw!r}; expected "
                            f"{b.true!r} or {b.false!r}")
        out.append(1.0 if raw == b.true else 0.0 if raw == b.false else math.nan)
    for name, c in spec.categorical.items():
        raw = cells[col[name]].strip()
        if raw in c.missing or raw in spec.missing:
            out.extend([math.nan] * len(c.values))
        elif raw in c.values:
            out.extend(1.0 if raw == v else 0.0 for v in c.values)
        else:
            raise DataError(f"{path}: {where}, column {name!r}: unknown category {raw!r}; expected one of "
                            f"{list(c.values)}" + (f" (or missing: {list(c.missing)})" if c.missing else ""))
    return out


def _label(path: Path, where: str, raw: str, spec: FeatureSpec) -> float:
    if spec.task == "regression":
        if raw in spec.missing:
            return math.nan  # unlabelled rows are dropped before training (docs/algorithms.md 17.1)
        try:
            return float(raw)
        except ValueError:
            raise DataError(f"{path}: {where}, column {spec.label!r}: label is not a number: "
                            f"{raw!r}") from None
    if raw not in spec.classes:
        what = "missing label" if raw in spec.missing else f"unknown label {raw!r}"
        raise DataError(f"{path}: {where}, column {spec.label!r}: {what}; expected one of "
                        f"{list(spec.classes)}")
    return float(spec.classes.index(raw))
