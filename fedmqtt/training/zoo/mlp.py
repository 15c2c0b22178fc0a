"""Multi-layer perceptron for tables: `(n, in_features)` -> `(n, out_features)` logits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fedmqtt.errors import ConfigError
from fedmqtt.training.zoo.common import NORMS, choice, feature_norm, positive_int, probability


class MLP(nn.Module):
    """Blocks of Linear -> norm -> ReLU -> dropout, then a Linear `head` producing logits `(n, out_features)`.

    `hidden=[]` is logistic regression (FLamby's heart-disease baseline).
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int] = (32, 32),
        out_features: int = 1,
        norm: str = "none",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        _check_mlp_args(in_features, hidden, out_features, norm, dropout)
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers.append(nn.Linear(width, size))
            layer = feature_norm(norm, size)
            if layer is not None:
                layers.append(layer)
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = size
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _check_mlp_args(in_features: Any, hidden: Any, out_features: Any, norm: Any, dropout: Any) -> None:
    positive_int("mlp", "in_features", in_features)
    if isinstance(hidden, (str, bytes)) or not isinstance(hidden, (list, tuple)):
        raise ConfigError(f"mlp: hidden must be a list of positive ints, got {hidden!r}")
    for size in hidden:
        positive_int("mlp", "hidden", size)
    positive_int("mlp", "out_features", out_features)
    choice("mlp", "norm", norm, NORMS)
    probability("mlp", "dropout", dropout)
