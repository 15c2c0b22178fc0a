"""Scoring a binary model on a split: sigmoid probabilities in eval mode, then whole-split metrics."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedmqtt.metrics import binary_metrics


def predict_scores(
    model: nn.Module, x: np.ndarray, *, device: str | torch.device = "cpu", batch_size: int = 1024
) -> np.ndarray:
    """Positive-class probabilities `(n,)` as float64, in eval mode without gradients.

    The model's train/eval mode is restored afterwards.
    """
    dev = torch.device(device)
    was_training = model.training
    model.to(dev).eval()
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32))
    parts: list[np.ndarray] = []
    try:
        with torch.inference_mode():
            for start in range(0, xt.shape[0], batch_size):
                logits = model(xt[start : start + batch_size].to(dev)).reshape(-1)
                parts.append(torch.sigmoid(logits.double()).cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)


def evaluate_split(
    model: nn.Module, x: np.ndarray, y: np.ndarray, *, device: str | torch.device = "cpu"
) -> tuple[dict[str, float | None], dict[str, str]]:
    """`binary_metrics` of the model's probabilities on `(x, y)` (None + reason where undefined)."""
    return binary_metrics(np.asarray(y), predict_scores(model, x, device=device))
