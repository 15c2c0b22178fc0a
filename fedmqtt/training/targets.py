"""The scale a regression model learns on, and an output layer that starts where the targets are.

A log target (TaskInfo.target = "log1p") is for skewed, non-negative targets such as lengths of stay: the
model learns log1p(y) with a squared error, which is the mean squared log error of expm1(output) against y,
and its output is read back with expm1. Labels and every metric stay on the original scale.

A fresh output layer predicts about 0 on the model's scale, far from targets whose mean is 2 (log days) or
8 (days): the first rounds are spent moving one bias, and a loss clamped at 0 (Scheltjens et al.'s final
ReLU) may never see a gradient. `init_output_bias` sets the regression output's bias to the mean target on
the model's scale from the start, so predictions begin at the site's typical value rather than at 0.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedmqtt.data.base import TaskInfo

# Model outputs beyond this (log scale) are read as this: expm1(20) is 4.9e8, so metrics stay finite however
# far a diverging model strays; no real length of stay comes near it.
LOG_OUTPUT_CAP = 20.0


def is_log_target(task: TaskInfo) -> bool:
    return task.kind == "regression" and task.target == "log1p"


def to_model_scale(y: np.ndarray, task: TaskInfo) -> np.ndarray:
    """Regression labels on the scale the model learns (log1p for a log target; NaN stays NaN).

    Raises:
        ValueError: a log target with a label below 0 (log1p is meant for non-negative targets).
    """
    if not is_log_target(task):
        return y
    y = np.asarray(y, dtype=np.float32)
    if bool(np.any(y[~np.isnan(y)] < 0)):
        raise ValueError("a log target needs labels >= 0 (it learns log1p(y)); turn log_target off for this data")
    return np.log1p(y)


def from_model_scale(out: torch.Tensor, task: TaskInfo) -> torch.Tensor:
    """Regression outputs on the labels' scale: expm1 of the (capped) output for a log target."""
    if not is_log_target(task):
        return out
    return torch.expm1(out.clamp(max=LOG_OUTPUT_CAP))


def output_layer(model: nn.Module) -> nn.Linear | None:
    """The model's output layer: its `head` (every model of the zoo has one), else its last Linear layer."""
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        return head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def init_output_bias(model: nn.Module, y_train: np.ndarray, task: TaskInfo) -> float | None:
    """Set a regression model's output bias to the mean labelled training target on the model's scale.

    Returns the value set, or None when there is nothing to do (not a regression, no labelled target, or no
    single-output Linear layer with a bias). The layer's weights are left as they are, so the inputs still
    move the predictions around the mean from the first step.
    """
    if task.kind != "regression":
        return None
    y = to_model_scale(np.asarray(y_train, dtype=np.float32).reshape(-1), task)
    y = y[~np.isnan(y)]
    layer = output_layer(model)
    if y.size == 0 or layer is None or layer.bias is None or layer.out_features != 1:
        return None
    value = float(np.mean(y, dtype=np.float64))
    with torch.no_grad():
        layer.bias.fill_(value)
    return value
