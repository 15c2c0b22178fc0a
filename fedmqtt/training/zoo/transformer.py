"""Transformer encoder for ICU sequences: `(n, T, n_features)` -> mean over time -> `(n, n_outputs)`."""

from __future__ import annotations

import math

import torch
from torch import nn

from fedmqtt.errors import ConfigError
from fedmqtt.training.zoo.common import SequenceNorm, choice, positive_int, probability

TRANSFORMER_NORMS: tuple[str, ...] = ("ln", "bn", "gn")


class EncoderBlock(nn.Module):
    """Post-norm encoder layer with a switchable norm (torch's own layer hard-codes LayerNorm)."""

    def __init__(self, d_model: int, heads: int, dropout: float, norm: str) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, heads, dropout=dropout, batch_first=True)
        self.norm1 = SequenceNorm(norm, d_model)
        self.ff = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.ReLU(), nn.Dropout(dropout), nn.Linear(4 * d_model, d_model)
        )
        self.norm2 = SequenceNorm(norm, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended, _ = self.attn(x, x, x, need_weights=False)
        x = self.norm1(x + self.drop(attended))
        return self.norm2(x + self.drop(self.ff(x)))


class TransformerNet(nn.Module):
    """Linear embedding + sinusoidal positions -> `layers` encoder blocks -> mean over time -> `head`."""

    def __init__(
        self,
        n_features: int,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 2,
        dropout: float = 0.1,
        n_outputs: int = 1,
        norm: str = "ln",
    ) -> None:
        super().__init__()
        positive_int("transformer", "n_features", n_features)
        positive_int("transformer", "d_model", d_model)
        positive_int("transformer", "heads", heads)
        positive_int("transformer", "layers", layers)
        probability("transformer", "dropout", dropout)
        positive_int("transformer", "n_outputs", n_outputs)
        choice("transformer", "norm", norm, TRANSFORMER_NORMS)
        if d_model % heads:
            raise ConfigError(f"transformer: d_model ({d_model}) must be divisible by heads ({heads})")
        self.embed = nn.Linear(n_features, d_model)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Sequential(*(EncoderBlock(d_model, heads, dropout, norm) for _ in range(layers)))
        self.head = nn.Linear(d_model, n_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 3:
            raise ValueError(f"transformer expects (n, T, features) inputs, got {tuple(x.shape)}")
        h = self.embed(x)
        # Computed, not stored: a buffer would travel as FLOATBUF although it is a constant.
        h = self.drop(h + positional_encoding(h.shape[1], h.shape[2], h.device, h.dtype))
        return self.head(self.encoder(h).mean(dim=1))


def positional_encoding(length: int, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The sinusoidal table of Vaswani et al., `(length, width)`."""
    position = torch.arange(length, dtype=torch.float32, device=device).unsqueeze(1)
    even = torch.arange(0, width, 2, dtype=torch.float32, device=device)
    rate = torch.exp(even * (-math.log(10000.0) / width))
    table = torch.zeros(length, width, device=device)
    table[:, 0::2] = torch.sin(position * rate)
    table[:, 1::2] = torch.cos(position * rate)[:, : width // 2]
    return table.to(dtype)
