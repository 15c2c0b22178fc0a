"""What a learning task is, independent of the data's modality (tables, images, ECG, ICU series)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from fedmqtt.errors import DataError

TaskKind = Literal["binary", "multiclass", "multilabel", "regression"]
TargetScale = Literal["identity", "log1p"]


@dataclass(frozen=True)
class TaskInfo:
    """How labels look and how a model's outputs are read.

    binary: y int64 (n,) in {0, 1}, one logit; multiclass: y int64 (n,) in [0, n_outputs), one logit
    per class; multilabel: y float32 (n, n_outputs) in {0, 1} with NaN where a label is not annotated
    (partial labels: masked in loss and metrics); regression: y float32 (n,), one output.

    target (regression only): "log1p" means the model learns log1p(y) and its output is read back with expm1
    (fedmqtt.training.targets), for skewed targets such as lengths of stay; y and every metric stay on the
    original scale.
    """

    kind: TaskKind = "binary"
    n_outputs: int = 1
    label_names: tuple[str, ...] = ()
    target: TargetScale = "identity"


BINARY = TaskInfo("binary", 1, ("0", "1"))


def parse_number(raw: str, *, where: str) -> float:
    """A finite float from a data cell, or a DataError that starts with `where` (file, line, column)."""
    try:
        value = float(raw)
    except ValueError:
        raise DataError(f"{where}: not a number: {raw!r}") from None
    if not math.isfinite(value):
        raise DataError(f"{where}: not a finite number: {raw!r}")
    return value
