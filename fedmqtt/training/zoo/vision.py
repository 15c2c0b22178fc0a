"""torchvision backbones (DenseNet-121, EfficientNet-B0, AlexNet) with the optional [vision] extra.

Random initialisation only (pretrained weights arrive as a checkpoint, never downloaded on a site);
inputs `(n, in_channels, h, w)` of at least 64 pixels a side (their strides shrink 28x28 to nothing).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import nn

from fedmqtt.errors import ConfigError
from fedmqtt.training.zoo.common import channel_norm, choice, positive_int, probability


def _torchvision_models() -> ModuleType:
    """`torchvision.models`, imported on first use so the base install never needs torchvision."""
    try:
        return importlib.import_module("torchvision.models")
    except ImportError as exc:
        raise ConfigError(
            "torchvision backbones need torchvision: install the [vision] extra "
            "(pip install 'fedmqtt[vision]')"
        ) from exc


class Backbone(nn.Module):
    """A torchvision network whose classifier ends before its last Linear, plus that Linear as `head`."""

    def __init__(self, body: nn.Module, width: int, n_outputs: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(width, n_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _swap_batchnorm(module: nn.Module, norm: str) -> None:
    """Replace every BatchNorm2d below `module` by the GroupNorm / channel LayerNorm of the same width."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            replacement = channel_norm(norm, child.num_features, 2)
            setattr(module, name, replacement if replacement is not None else nn.Identity())
        else:
            _swap_batchnorm(child, norm)


def _set_in_channels(module: nn.Module, in_channels: int) -> None:
    """Rebuild the first Conv2d for `in_channels` inputs (grayscale MedMNIST has 1)."""
    for parent in module.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                if child.in_channels != in_channels:
                    # _ConvNd types its sizes for any N; a Conv2d's are pairs
                    kernel_h, kernel_w = child.kernel_size
                    stride_h, stride_w = child.stride
                    padding = child.padding if isinstance(child.padding, str) else (child.padding[0], child.padding[1])
                    setattr(parent, name, nn.Conv2d(
                        in_channels, child.out_channels, (kernel_h, kernel_w), stride=(stride_h, stride_w),
                        padding=padding, bias=child.bias is not None))
                return


def _set_dropout(module: nn.Module, rate: float) -> None:
    # Set after construction: older torchvision builders take no `dropout` keyword (or pass it twice).
    for child in module.modules():
        if isinstance(child, nn.Dropout):
            child.p = rate


def _finish(net: nn.Module, last: nn.Linear, n_outputs: int, in_channels: int, norm: str) -> Backbone:
    if norm != "bn":
        _swap_batchnorm(net, norm)
    _set_in_channels(net, in_channels)
    return Backbone(net, last.in_features, n_outputs)


def densenet121(n_outputs: int = 1, in_channels: int = 3, norm: str = "bn") -> Backbone:
    """DenseNet-121 (random init; pretrained weights come as a checkpoint), BN or GN/LN/none swapped in."""
    _check("densenet121", n_outputs, in_channels, norm)
    net = _torchvision_models().densenet121(weights=None)
    last = net.classifier
    net.classifier = nn.Identity()
    return _finish(net, last, n_outputs, in_channels, norm)


def efficientnet_b0(
    n_outputs: int = 1, in_channels: int = 3, norm: str = "bn", dropout: float = 0.2
) -> Backbone:
    """EfficientNet-B0 (Hwang et al.'s skin task, BN or GN), random init; its classifier dropout stays in `body`."""
    _check("efficientnet_b0", n_outputs, in_channels, norm)
    rate = probability("efficientnet_b0", "dropout", dropout)
    net = _torchvision_models().efficientnet_b0(weights=None)
    _set_dropout(net.classifier, rate)
    last = net.classifier[-1]
    net.classifier[-1] = nn.Identity()
    return _finish(net, last, n_outputs, in_channels, norm)


def alexnet(n_outputs: int = 1, in_channels: int = 3, dropout: float = 0.5) -> Backbone:
    """AlexNet (no normalisation layers), random init."""
    _check("alexnet", n_outputs, in_channels, "none")
    rate = probability("alexnet", "dropout", dropout)
    net = _torchvision_models().alexnet(weights=None)
    _set_dropout(net.classifier, rate)
    last = net.classifier[-1]
    net.classifier[-1] = nn.Identity()
    return _finish(net, last, n_outputs, in_channels, "none")  # no BatchNorm to swap


def _check(model: str, n_outputs: int, in_channels: int, norm: str) -> None:
    positive_int(model, "n_outputs", n_outputs)
    positive_int(model, "in_channels", in_channels)
    choice(model, "norm", norm, ("bn", "gn", "ln", "none"))
