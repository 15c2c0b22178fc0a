"""LeNet-5 for small images (MedMNIST 28x28): `(n, in_channels, s, s)` -> `(n, n_classes)` logits."""

from __future__ import annotations

import torch
from torch import nn

from fedmqtt.errors import ConfigError
from fedmqtt.training.zoo.common import (
    NORMS,
    channel_norm,
    choice,
    feature_norm,
    flag,
    positive_int,
    probability,
)


class LeNet5(nn.Module):
    """conv5x5(6, pad 2) -> pool -> conv5x5(16) -> pool -> fc120 -> fc84 -> `head`, ReLU and max-pooling.

    `norm` follows every convolution (BatchNorm2d, GroupNorm, or a per-position LayerNorm over channels)
    and, with `norm_dense` (the default), every hidden fully connected layer (BatchNorm1d, GroupNorm,
    LayerNorm). `pad_first=False` drops the first convolution's padding (28 -> 24 -> 12 -> 8 -> 4, so fc1
    reads 16 x 4 x 4 = 256 features instead of 400). `pad_first=False, norm_dense=False` with norm "bn" is
    the LeNet of Chen et al.'s AdaFed reference code (BatchNorm after the two convolutions only); the
    defaults keep the zoo's original model, so runs made before these options stay bit-identical.
    """

    def __init__(
        self,
        n_classes: int,
        in_channels: int = 1,
        norm: str = "none",
        image_size: int = 28,
        dropout: float = 0.0,
        pad_first: bool = True,
        norm_dense: bool = True,
    ) -> None:
        super().__init__()
        positive_int("lenet5", "n_classes", n_classes)
        positive_int("lenet5", "in_channels", in_channels)
        choice("lenet5", "norm", norm, NORMS)
        positive_int("lenet5", "image_size", image_size)
        probability("lenet5", "dropout", dropout)
        flag("lenet5", "pad_first", pad_first)
        flag("lenet5", "norm_dense", norm_dense)
        padding = 2 if pad_first else 0
        # 28 -> 28 (pad 2) -> 14 -> 10 -> 5; without the padding 28 -> 24 -> 12 -> 8 -> 4.
        side = ((image_size + 2 * padding - 4) // 2 - 4) // 2
        if side < 1:
            smallest = 12 if pad_first else 16
            raise ConfigError(f"lenet5: image_size must be >= {smallest}, got {image_size}")
        self.features = nn.Sequential(
            *_conv_block(in_channels, 6, norm, padding=padding), *_conv_block(6, 16, norm, padding=0)
        )
        dense_norm = norm if norm_dense else "none"
        self.classifier = nn.Sequential(
            nn.Flatten(),
            *_fc_block(16 * side * side, 120, dense_norm, dropout),
            *_fc_block(120, 84, dense_norm, dropout),
        )
        self.head = nn.Linear(84, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.classifier(self.features(x)))


def _conv_block(c_in: int, c_out: int, norm: str, *, padding: int) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, 5, padding=padding)]
    layer = channel_norm(norm, c_out, 2)
    return [*layers, *([layer] if layer is not None else []), nn.ReLU(), nn.MaxPool2d(2)]


def _fc_block(width_in: int, width_out: int, norm: str, dropout: float) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.Linear(width_in, width_out)]
    layer = feature_norm(norm, width_out)
    layers += [*([layer] if layer is not None else []), nn.ReLU()]
    return layers + ([nn.Dropout(dropout)] if dropout > 0 else [])
