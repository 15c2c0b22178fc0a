"""Switchable normalisation layers and argument checks shared by every model of the zoo."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from fedmqtt.errors import ConfigError

NORMS: tuple[str, ...] = ("none", "bn", "ln", "gn")


def gn_groups(width: int) -> int:
    """Groups for GroupNorm: at most 8, each of >= 4 channels where possible, dividing `width`."""
    # Groups of 1 channel would normalise every feature to 0 on (n, c) inputs.
    for groups in range(min(8, width // 4), 1, -1):
        if width % groups == 0:
            return groups
    return 1


class ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over the channel axis of `(n, C, *spatial)` maps, at every position (ConvNeXt style).

    A subclass, so the manifest tags it NORM (a LayerNorm by module type) and FedBN's "layernorm" family
    finds it; unlike `nn.LayerNorm([C, H, W])` its affine shape does not depend on the input size.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.movedim(1, -1)).movedim(-1, 1)


def feature_norm(norm: str, width: int) -> nn.Module | None:
    """Normalisation of `(n, width)` features, or None for "none"."""
    if norm == "bn":
        return nn.BatchNorm1d(width)
    if norm == "ln":
        return nn.LayerNorm(width)
    if norm == "gn":
        return nn.GroupNorm(gn_groups(width), width)
    return None


def channel_norm(norm: str, channels: int, dims: int) -> nn.Module | None:
    """Normalisation of `(n, channels, *spatial)` maps with `dims` spatial axes (1 or 2), or None."""
    if norm == "bn":
        return nn.BatchNorm1d(channels) if dims == 1 else nn.BatchNorm2d(channels)
    if norm == "ln":
        return ChannelLayerNorm(channels)
    if norm == "gn":
        return nn.GroupNorm(gn_groups(channels), channels)
    return None


class SequenceNorm(nn.Module):
    """Normalisation of `(n, T, d)` token sequences: BN/GN see `(n, d, T)`, LN normalises each token.

    BN and GN get channels on axis 1, as every BatchNorm input elsewhere (AdaFed's statistics read axis 1).
    """

    def __init__(self, norm: str, width: int) -> None:
        super().__init__()
        layer = channel_norm(norm, width, 1) if norm != "ln" else nn.LayerNorm(width)
        if layer is None:
            raise ConfigError("SequenceNorm needs bn, gn or ln")
        self.norm = layer
        self.channels_first = norm != "ln"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_first:
            return self.norm(x.transpose(1, 2)).transpose(1, 2)
        return self.norm(x)


def positive_int(model: str, name: str, value: Any, *, minimum: int = 1) -> int:
    """`value` if it is an int >= `minimum` (bools refused), else ConfigError naming model and argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{model}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def probability(model: str, name: str, value: Any) -> float:
    """`value` as a float in [0, 1), else ConfigError (dropout rates)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{model}: {name} must be in [0, 1), got {value!r}")
    return float(value)


def flag(model: str, name: str, value: Any) -> bool:
    """`value` if it is a bool (TOML true/false; 0 and 1 refused, so a typo cannot pass as a switch)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{model}: {name} must be true or false, got {value!r}")
    return value


def choice(model: str, name: str, value: Any, allowed: Collection[str]) -> str:
    """`value` if it is one of `allowed`, else ConfigError listing them."""
    if value not in allowed:
        raise ConfigError(f"{model}: {name} must be one of {list(allowed)}, got {value!r}")
    return str(value)


def int_list(model: str, name: str, value: Any) -> list[int]:
    """A non-empty list of positive ints (a tuple is accepted too), else ConfigError."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{model}: {name} must be a non-empty list of positive ints, got {value!r}")
    return [positive_int(model, name, v) for v in value]
