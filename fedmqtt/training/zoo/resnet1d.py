"""1-D ResNet with squeeze-excitation blocks for 12-lead ECG: `(n, in_leads, L)` -> `(n, n_outputs)`."""

from __future__ import annotations

import torch
from torch import nn

from fedmqtt.training.zoo.common import NORMS, channel_norm, choice, int_list, positive_int


def _norm(norm: str, channels: int) -> nn.Module:
    return channel_norm(norm, channels, 1) or nn.Identity()


class SqueezeExcite1d(nn.Module):
    """Channel gates from the time-averaged map: `x * sigmoid(fc2(relu(fc1(mean_t x))))` (Hu et al.)."""

    def __init__(self, channels: int, reduction: int) -> None:
        super().__init__()
        squeezed = max(channels // reduction, 4)
        self.fc1 = nn.Linear(channels, squeezed)
        self.fc2 = nn.Linear(squeezed, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean(dim=2)))))
        return x * gate.unsqueeze(2)


class BasicBlock1d(nn.Module):
    """conv -> norm -> ReLU -> conv -> norm -> SE, plus the (projected) input, then ReLU."""

    def __init__(
        self, c_in: int, c_out: int, stride: int, kernel_size: int, norm: str, reduction: int
    ) -> None:
        super().__init__()
        bias = norm == "none"  # a bias right before a normalisation layer is redundant
        pad = kernel_size // 2
        self.conv1 = nn.Conv1d(c_in, c_out, kernel_size, stride=stride, padding=pad, bias=bias)
        self.norm1 = _norm(norm, c_out)
        self.conv2 = nn.Conv1d(c_out, c_out, kernel_size, padding=pad, bias=bias)
        self.norm2 = _norm(norm, c_out)
        self.se = SqueezeExcite1d(c_out, reduction)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            projection = nn.Conv1d(c_in, c_out, 1, stride=stride, bias=bias)
            self.shortcut = nn.Sequential(projection, _norm(norm, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.se(self.norm2(self.conv2(out)))
        return torch.relu(out + self.shortcut(x))


class ResNet1dSE(nn.Module):
    """Stem (conv k15/2, norm, ReLU, max-pool /2), stages of SE basic blocks, global average pool, `head`.

    Stage i has `base * 2**i` channels and halves the length (except stage 0); `blocks[i]` blocks each.
    Inputs are `(n, in_leads, L)`: leads as channels, L samples (any L >= 8).
    """

    def __init__(
        self,
        in_leads: int = 12,
        n_outputs: int = 1,
        base: int = 32,
        blocks: list[int] | tuple[int, ...] = (2, 2, 2, 2),
        norm: str = "bn",
        kernel_size: int = 7,
        se_reduction: int = 8,
    ) -> None:
        super().__init__()
        positive_int("resnet1d_se", "in_leads", in_leads)
        positive_int("resnet1d_se", "n_outputs", n_outputs)
        positive_int("resnet1d_se", "base", base)
        counts = int_list("resnet1d_se", "blocks", blocks)
        choice("resnet1d_se", "norm", norm, NORMS)
        positive_int("resnet1d_se", "kernel_size", kernel_size)
        positive_int("resnet1d_se", "se_reduction", se_reduction)
        self.stem = nn.Sequential(
            nn.Conv1d(in_leads, base, 15, stride=2, padding=7, bias=norm == "none"),
            _norm(norm, base), nn.ReLU(), nn.MaxPool1d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        width = base
        for i, count in enumerate(counts):
            out = base * 2**i
            stage = [BasicBlock1d(width if j == 0 else out, out, 2 if (i > 0 and j == 0) else 1,
                                  kernel_size, norm, se_reduction) for j in range(count)]
            stages.append(nn.Sequential(*stage))
            width = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(width, n_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 3:
            raise ValueError(f"resnet1d_se expects (n, leads, samples) inputs, got {tuple(x.shape)}")
        return self.head(self.stages(self.stem(x)).mean(dim=2))
