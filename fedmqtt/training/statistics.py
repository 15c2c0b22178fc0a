"""Feature statistics for AdaFed's similarity matrix (docs/algorithms.md 11.1, 11.3), computed on a site.

Per channel: the mean and the population variance over all samples and non-channel positions.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

Stats = dict[str, tuple[np.ndarray, np.ndarray]]
BN_INPUTS, PENULTIMATE, BN_RUNNING = 1, 2, 3  # the `feature_stats` codes a task may ask for


def _inputs_of(model: nn.Module, modules: Mapping[str, nn.Module], x: np.ndarray, batch_size: int = 1024) -> Stats:
    """Statistics of the tensors entering `modules`, with `model` in eval mode (no buffer changes)."""
    from fedmqtt.strategies.adafed import feature_statistics  # here: only AdaFed's tasks ask; a site needs no rules

    seen: dict[str, list[np.ndarray]] = {name: [] for name in modules}
    hooks = [m.register_forward_pre_hook(
        lambda _m, args, name=name: seen[name].append(args[0].detach().double().numpy()))
        for name, m in modules.items()]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            xt = torch.as_tensor(np.asarray(x, dtype=np.float32))
            for start in range(0, xt.shape[0], batch_size):
                model(xt[start:start + batch_size])
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return {name: feature_statistics(np.concatenate(parts), channel_axis=1) for name, parts in seen.items()}


def bn_modules(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def _running_statistics(name: str, bn: nn.modules.batchnorm._BatchNorm) -> tuple[np.ndarray, np.ndarray]:
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError(f"f-AdaFed needs BatchNorm running statistics; layer {name!r} does not track them")
    return bn.running_mean.double().numpy().copy(), bn.running_var.double().numpy().copy()


def site_statistics(kind: int, *, pretrained: nn.Module | None, trained: nn.Module, x_train: np.ndarray) -> Stats:
    """AdaFed: inputs of every BN layer of the pretrained model; d-AdaFed: input of its output layer
    (`head`); f-AdaFed: the site's own BN running statistics after its warm-up rounds."""
    if kind == BN_RUNNING:
        return {n: _running_statistics(n, m) for n, m in bn_modules(trained).items()}
    if pretrained is None:
        raise ValueError("AdaFed statistics need the pretrained model, which the PS did not send")
    if kind == BN_INPUTS:
        modules = bn_modules(pretrained)
        if not modules:
            raise ValueError("adafed needs BatchNorm layers (use d-adafed for models without them)")
        return _inputs_of(pretrained, modules, x_train)
    if kind == PENULTIMATE:
        head = getattr(pretrained, "head", None)
        if head is None:
            raise ValueError("d-adafed needs a model whose output layer is named `head`")
        return _inputs_of(pretrained, {"head": head}, x_train)
    raise ValueError(f"unknown feature statistics kind {kind}")
