"""UCI heart disease (four hospitals): parse one processed file into a fixed 15-feature matrix."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Final

import numpy as np

from fedmqtt.data.base import parse_number
from fedmqtt.errors import DataError

SITES: tuple[str, ...] = ("cleveland", "hungary", "switzerland", "va")
SITE_FILES: Final[dict[str, str]] = {
    "cleveland": "processed.cleveland.data",
    "hungary": "processed.hungarian.data",
    "switzerland": "processed.switzerland.data",
    "va": "processed.va.data",
}

RAW_COLUMNS: tuple[str, ...] = (
    "age", "sex", "cp", "trestbps", "chol", "fbs", "restecg",
    "thalach", "exang", "oldpeak", "slope", "ca", "thal", "num",
)  # fmt: skip
NUMERIC: tuple[str, ...] = ("age", "trestbps", "chol", "thalach", "oldpeak")
BINARY: tuple[str, ...] = ("sex", "fbs", "exang")
# The one-hot vocabularies are fixed from the UCI codebook, never learned from pooled data
# (FLamby's catch): every site must produce the same columns without seeing the others.
CATEGORICAL: tuple[tuple[str, tuple[int, ...]], ...] = (("cp", (1, 2, 3, 4)), ("restecg", (0, 1, 2)))
# slope, ca and thal are dropped: most rows outside Cleveland lack them.
DROPPED: tuple[str, ...] = ("slope", "ca", "thal")
# The files code "not measured" as 0 for these (no living patient has 0 mmHg or 0 mg/dl).
ZERO_MEANS_MISSING: frozenset[str] = frozenset({"chol", "trestbps"})
LABEL = "num"

FEATURE_NAMES: tuple[str, ...] = (
    *NUMERIC,
    *BINARY,
    *(f"{name}_{value}" for name, vocab in CATEGORICAL for value in vocab),
)

_COL = {name: i for i, name in enumerate(RAW_COLUMNS)}


def bundled_path(site: str) -> Path:
    """Path of the bundled processed file of `site` (one of `SITES`)."""
    if site not in SITE_FILES:
        raise DataError(f"unknown heart-disease site {site!r}; known sites: {', '.join(SITES)}")
    return Path(__file__).resolve().parent.parent / "bundled" / "heart_disease" / SITE_FILES[site]


def load_site_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse one processed UCI file.

    Args:
        path: a headerless 14-column file with `?` for missing values.

    Returns:
        `(x, y)`: float64 features `(n, 15)` in `FEATURE_NAMES` order with NaN where missing
        (all one-hot columns of a variable are NaN when it is missing), and int64 labels `num > 0`.

    Raises:
        DataError: the file is unreadable or malformed; the message names file, line and column.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read heart-disease file: {exc}") from exc
    rows: list[np.ndarray] = []
    labels: list[int] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue  # tolerate blank lines (e.g. a trailing newline pair)
        raw = _parse_line(path, line_no, line)
        rows.append(_encode_row(path, line_no, raw))
        labels.append(_label(path, line_no, raw))
    if not rows:
        raise DataError(f"{path}: no data rows")
    return np.vstack(rows), np.asarray(labels, dtype=np.int64)


def _where(path: Path, line_no: int, column: str) -> str:
    return f"{path}: line {line_no}, column {_COL[column] + 1} ({column})"


def _parse_line(path: Path, line_no: int, line: str) -> list[float]:
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != len(RAW_COLUMNS):
        raise DataError(
            f"{path}: line {line_no}: expected {len(RAW_COLUMNS)} comma-separated columns "
            f"({', '.join(RAW_COLUMNS)}), found {len(fields)}"
        )
    values: list[float] = []
    for name, field in zip(RAW_COLUMNS, fields, strict=True):
        if field in ("?", ""):
            values.append(math.nan)
            continue
        values.append(parse_number(field, where=_where(path, line_no, name)))
    return values


def _encode_row(path: Path, line_no: int, raw: list[float]) -> np.ndarray:
    out: list[float] = []
    for name in NUMERIC:
        value = raw[_COL[name]]
        out.append(math.nan if name in ZERO_MEANS_MISSING and value == 0 else value)
    for name in BINARY:
        out.append(_check_code(path, line_no, name, raw[_COL[name]], (0, 1)))
    for name, vocab in CATEGORICAL:
        value = _check_code(path, line_no, name, raw[_COL[name]], vocab)
        if math.isnan(value):
            out.extend([math.nan] * len(vocab))
        else:
            out.extend(1.0 if value == v else 0.0 for v in vocab)
    return np.asarray(out, dtype=np.float64)


def _check_code(path: Path, line_no: int, name: str, value: float, vocab: tuple[int, ...]) -> float:
    if not math.isnan(value) and value not in vocab:
        raise DataError(
            f"{_where(path, line_no, name)}: unknown category {value:g}; expected one of {list(vocab)}"
        )
    return value


def _label(path: Path, line_no: int, raw: list[float]) -> int:
    value = raw[_COL[LABEL]]
    if math.isnan(value):
        raise DataError(f"{_where(path, line_no, LABEL)}: missing label")
    if value < 0 or value != int(value):
        raise DataError(f"{_where(path, line_no, LABEL)}: label must be an integer 0-4, got {value:g}")
    return int(value > 0)
