"""DP-SGD's step with per-record gradients from torch.func (`functional_call`, `vmap`, `grad`), beside Opacus.

The same mechanism as Opacus' DPOptimizer (fedmqtt/training/privacy.py): each record's gradient clipped to C by
the factor min(1, C / (||g_i|| + 1e-6)), Gaussian noise of std sigma * C on the clipped sum drawn from the round's
generator in parameter order (Opacus' non-secure `_generate_noise`), the sum divided by the expected batch size,
then the site's torch optimiser. With the same generator the two draw the same noise, which
tests/unit/test_dp_per_sample.py checks step for step.

Why a second path: on small models a DP step is dominated by Python and hook overhead, and one vmapped
per-record backward does less work than ghost clipping's two passes. It materialises a batch of gradients
(batch x parameters floats), so it serves models whose layers vmap can batch: `unsupported` says which cannot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

# Layers whose forward keeps no state between records and which vmap batches (the zoo's MLP, LeNet, 1-D ResNet
# with GroupNorm/LayerNorm). Anything else (recurrent layers, attention, BatchNorm's running statistics, a
# module from elsewhere) is left to Opacus.
_SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.GroupNorm, nn.LayerNorm, nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh,
              nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
              nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.Flatten, nn.Identity, nn.Dropout, nn.Sequential,
              nn.ModuleList)

# One record's loss from (parameters, buffers, x, y): the per-record loss (reduction "none") of a batch of one.
RecordLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def unsupported(model: nn.Module) -> list[str]:
    """Layer types of `model` this path does not serve (empty: it serves the model). Container classes of the
    zoo count as served when every leaf below them is."""
    leaves = [m for m in model.modules() if not list(m.children())]
    return sorted({type(m).__name__ for m in leaves if not isinstance(m, _SUPPORTED)})


class PerRecordGradients:
    """Each record's gradient of its own loss, {parameter name: (batch, *shape)}, and the records' losses.

    Built once per round: the parameters are held as detached views of the model's own tensors, which the
    optimiser updates in place, so every call sees the current weights without walking the module tree again
    (on the zoo's small MLP that walk cost about a tenth of a step)."""

    def __init__(self, model: nn.Module, record_loss: RecordLoss) -> None:
        self.named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        self.params = {k: p.detach() for k, p in self.named}
        frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
        buffers = dict(model.named_buffers())

        def one(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = functional_call(model, ({**p, **frozen}, buffers), (x.unsqueeze(0),))
            return record_loss(out.float(), y.unsqueeze(0))[0]

        # randomness "different": a dropout layer draws each record's own mask, as in a batched forward.
        self._batched = vmap(grad_and_value(one), in_dims=(None, 0, 0), randomness="different")

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        grads, losses = self._batched(self.params, xb, yb)
        return grads, losses


def per_record_gradients(model: nn.Module, record_loss: RecordLoss, xb: torch.Tensor, yb: torch.Tensor
                         ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """PerRecordGradients for one batch."""
    return PerRecordGradients(model, record_loss)(xb, yb)


def clipped_sum(grads: dict[str, torch.Tensor], max_grad_norm: float) -> dict[str, torch.Tensor]:
    """sum_i g_i * min(1, C / (||g_i|| + 1e-6)), ||g_i|| over all of record i's parameters (Opacus' rule)."""
    first = next(iter(grads.values()))
    norms = torch.stack([g.reshape(g.shape[0], -1).norm(2, dim=1) for g in grads.values()], dim=1).norm(2, dim=1)
    coef = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0).to(first.dtype)
    return {k: torch.einsum("i,i...->...", coef, g) for k, g in grads.items()}


def dp_step(per_record: PerRecordGradients, optimizer: torch.optim.Optimizer, xb: torch.Tensor,
            yb: torch.Tensor, *, max_grad_norm: float, noise_multiplier: float, expected_batch_size: int,
            generator: torch.Generator) -> torch.Tensor:
    """One DP-SGD step on the batch (possibly empty: then noise alone); returns the records' losses."""
    if len(yb):
        grads, losses = per_record(xb, yb)
        summed = clipped_sum(grads, max_grad_norm)
    else:
        summed, losses = {k: torch.zeros_like(p) for k, p in per_record.named}, torch.zeros(0, device=xb.device)
    std = noise_multiplier * max_grad_norm
    for k, p in per_record.named:  # the optimiser's parameter order, as Opacus draws its noise
        noise = torch.normal(mean=0, std=std, size=p.shape, device=p.device, generator=generator) if std > 0 \
            else torch.zeros_like(p)
        p.grad = (summed[k] + noise) / expected_batch_size
    optimizer.step()
    return losses.detach()
