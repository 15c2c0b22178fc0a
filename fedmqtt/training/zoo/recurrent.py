"""GRU for ICU sequences: `(n, T, n_features + static_features)` -> `(n, n_outputs)`."""

from __future__ import annotations

import torch
from torch import nn

from fedmqtt.training.zoo.common import NORMS, choice, feature_norm, positive_int, probability


class GRUNet(nn.Module):
    """Stacked GRU over time; its last hidden state (plus static features) -> norm -> `head`.

    Layout: x is `(n, T, n_features + static_features)`. The first `n_features` columns are the
    time-varying measurements. When `static_features > 0`, the last `static_features` columns of
    `x[:, 0, :]` are the patient's static vector (age, sex, ...; their values at t > 0 are ignored),
    concatenated to the GRU summary before the output layer.
    """

    def __init__(
        self,
        n_features: int,
        hidden: int = 32,
        layers: int = 2,
        dropout: float = 0.05,
        n_outputs: int = 1,
        static_features: int = 0,
        norm: str = "none",
    ) -> None:
        super().__init__()
        positive_int("gru", "n_features", n_features)
        positive_int("gru", "hidden", hidden)
        positive_int("gru", "layers", layers)
        probability("gru", "dropout", dropout)
        positive_int("gru", "n_outputs", n_outputs)
        positive_int("gru", "static_features", static_features, minimum=0)
        choice("gru", "norm", norm, NORMS)
        self.n_features, self.static_features = n_features, static_features
        # torch applies GRU dropout between stacked layers only; with one layer it would warn and do nothing.
        self.gru = nn.GRU(n_features, hidden, num_layers=layers, batch_first=True,
                          dropout=dropout if layers > 1 else 0.0)
        width = hidden + static_features
        self.norm = feature_norm(norm, width) or nn.Identity()
        self.head = nn.Linear(width, n_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 3 or x.shape[2] != self.n_features + self.static_features:
            raise ValueError(
                f"gru expects (n, T, {self.n_features + self.static_features}) inputs, got {tuple(x.shape)}"
            )
        _, h_last = self.gru(x[:, :, : self.n_features])
        summary = h_last[-1]  # top layer's state after the last step
        if self.static_features:
            summary = torch.cat([summary, x[:, 0, self.n_features :]], dim=1)
        return self.head(self.norm(summary))
