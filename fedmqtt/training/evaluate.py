"""Scoring a model on a split: task-shaped probabilities in eval mode, then whole-split metrics."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from fedmqtt.data.base import BINARY, TaskInfo
from fedmqtt.metrics import Metrics, Reasons, task_metrics
from fedmqtt.training.targets import from_model_scale

# Rows per forward pass on the CPU. At 1024 the first layers' activations (LeNet-5: 1024 x 6 x 28 x 28 floats,
# 19 MB) leave the cache and a split was scored at half the speed it is at 256 (bench/sim_vs_bare.py: the
# sites' validation pass every round and the final evaluation). Each row's outputs are the same bits at either
# size for every zoo model (tests/unit/test_eval_batch_rows.py). Other devices keep the larger batch.
CPU_BATCH_ROWS = 256
DEVICE_BATCH_ROWS = 1024


def batch_rows(device: str | torch.device) -> int:
    """The default rows per forward pass when scoring on `device`."""
    return CPU_BATCH_ROWS if torch.device(device).type == "cpu" else DEVICE_BATCH_ROWS


def _read_out(outputs: torch.Tensor, task: TaskInfo, nonnegative: bool) -> torch.Tensor:
    """Model outputs -> what the metrics read, in float64 (sigmoid, softmax or the regression value)."""
    out = outputs.double()
    if task.kind == "binary":
        return torch.sigmoid(out.reshape(-1))
    if task.kind == "multiclass":
        return torch.softmax(out.reshape(out.shape[0], -1), dim=1)  # over all classes (docs/algorithms.md 17.2)
    if task.kind == "multilabel":
        return torch.sigmoid(out.reshape(out.shape[0], -1))
    out = from_model_scale(out.reshape(-1), task)  # expm1 for a log target: metrics read the labels' scale
    return out.clamp(min=0.0) if nonnegative else out


def predict(
    model: nn.Module,
    x: np.ndarray,
    task: TaskInfo = BINARY,
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    nonnegative: bool = False,
) -> np.ndarray:
    """The model's predictions on `x` (any rank, rows first) as float64, in eval mode without gradients.

    Args:
        model: restored to its train/eval mode afterwards.
        x: inputs as the data layer gives them.
        task: binary -> positive-class probabilities `(n,)`; multiclass -> softmax over all classes
            `(n, C)`; multilabel -> per-label sigmoid `(n, L)`; regression -> values `(n,)` on the labels'
            scale (expm1 of the output for a log target).
        device: where the forward passes run; batches are moved there one at a time.
        batch_size: rows per forward pass (default `batch_rows(device)`).
        nonnegative: regression only, clamp predictions at 0 (length of stay, Scheltjens et al.'s final ReLU).
    """
    parts = _forward_batches(model, x, device, batch_size, lambda out: _read_out(out, task, nonnegative))
    if parts:
        return np.concatenate(parts)
    width = () if task.kind in ("binary", "regression") else (task.n_outputs,)
    return np.zeros((0, *width), dtype=np.float64)


def predict_scores(
    model: nn.Module, x: np.ndarray, *, device: str | torch.device = "cpu", batch_size: int | None = None
) -> np.ndarray:
    """Positive-class probabilities `(n,)` of a binary model (`predict` with the binary task)."""
    return predict(model, x, BINARY, device=device, batch_size=batch_size)


def evaluate_split(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    task: TaskInfo = BINARY,
    device: str | torch.device = "cpu",
    nonnegative: bool = False,
) -> tuple[Metrics, Reasons]:
    """`task_metrics` of the model's predictions on `(x, y)`: values, and a reason for each None."""
    scores = predict(model, x, task, device=device, nonnegative=nonnegative)
    return task_metrics(task, np.asarray(y), scores)


def predict_logits(
    model: nn.Module, x: np.ndarray, *, device: str | torch.device = "cpu", batch_size: int | None = None
) -> np.ndarray:
    """A binary model's raw outputs (logits) `(n,)` as float64, in eval mode without gradients: what the
    membership-inference audit reads (fedmqtt.privacy_audit), where a saturated sigmoid would tie records."""
    parts = _forward_batches(model, x, device, batch_size, lambda out: out.reshape(-1).double())
    return np.concatenate(parts) if parts else np.zeros((0,), dtype=np.float64)


def _forward_batches(model: nn.Module, x: np.ndarray, device: str | torch.device, batch_size: int | None,
                     read: Callable[[torch.Tensor], torch.Tensor]) -> list[np.ndarray]:
    """`read` of the model's outputs, batch by batch, in eval mode without gradients; the model's mode is
    restored afterwards (a site evaluates between training epochs)."""
    dev = torch.device(device)
    batch_size = batch_rows(dev) if batch_size is None else batch_size
    was_training = model.training
    model.to(dev).eval()
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32))
    parts: list[np.ndarray] = []
    try:
        with torch.inference_mode():
            for start in range(0, xt.shape[0], batch_size):
                parts.append(read(model(xt[start : start + batch_size].to(dev))).cpu().numpy())
    finally:
        model.train(was_training)
    return parts
