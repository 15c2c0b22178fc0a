"""Model registry (name + args, never code) and the tensor manifest that tags state for the server."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fedmqtt.errors import ConfigError
from fedmqtt.training.zoo import (
    MLP,
    NORMS,
    GRUNet,
    LeNet5,
    ResNet1dSE,
    TransformerNet,
    alexnet,
    densenet121,
    efficientnet_b0,
    gn_groups,
)

__all__ = [
    "MLP", "MODELS", "NORMS", "build_model", "gn_groups", "model_manifest", "tensor_manifest", "wire_dtype",
]

# Classified by module type (docs/algorithms.md 0.2): names like "bn" in keys are never trusted.
_NORM_TYPES: tuple[type[nn.Module], ...] = tuple(
    t
    for t in (
        nn.modules.batchnorm._BatchNorm,  # BatchNorm1d/2d/3d, SyncBatchNorm, lazy variants
        nn.modules.instancenorm._InstanceNorm,
        nn.GroupNorm,
        nn.LayerNorm,  # also the zoo's ChannelLayerNorm
        getattr(nn, "RMSNorm", None),
    )
    if t is not None
)

# Registry names -> factories; arguments are the factories' keyword arguments (fedmqtt.training.zoo).
MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "lenet5": LeNet5,
    "gru": GRUNet,
    "transformer": TransformerNet,
    "resnet1d_se": ResNet1dSE,
    # Optional [vision] extra: torchvision is imported when one of these is built.
    "densenet121": densenet121,
    "efficientnet_b0": efficientnet_b0,
    "alexnet": alexnet,
}


def build_model(spec_name: str, args: dict[str, Any]) -> nn.Module:
    """Build registered model `spec_name` with keyword `args`.

    Raises:
        ConfigError: unknown name (lists the known ones), unknown or missing argument, or a bad value.
    """
    factory = MODELS.get(spec_name)
    if factory is None:
        raise ConfigError(f"unknown model {spec_name!r}; known models: {', '.join(sorted(MODELS))}")
    params = inspect.signature(factory).parameters
    unknown = sorted(set(args) - set(params))
    if unknown:
        raise ConfigError(
            f"model {spec_name!r}: unknown argument(s) {unknown}; accepted: {', '.join(params)}"
        )
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in args]
    if missing:
        raise ConfigError(f"model {spec_name!r}: missing required argument(s) {missing}")
    try:
        return factory(**args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model {spec_name!r}: bad arguments {args!r}: {exc}") from exc


def wire_dtype(tensor: torch.Tensor) -> str:
    """The numpy dtype a tensor travels as: float32 for any float, int64 for ints and bools."""
    return "float32" if tensor.is_floating_point() else "int64"


def tensor_manifest(model: nn.Module, *, head: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """Shape, dtype and group tags of every state-dict key (docs/algorithms.md 0.2).

    Tags: TRAIN (float parameter with requires_grad), NORM:<ModuleType> (anything owned by a
    normalisation module), FLOATBUF / INTBUF (float / integer buffers), HEAD (owned by one of the
    module names in `head`, e.g. FedPer's personal layers).

    Returns:
        `{key: {"shape": [..], "dtype": wire dtype, "tags": [..]}}` in state-dict order.
    """
    heads = tuple(head)
    manifest: dict[str, dict[str, Any]] = {}
    for key, tensor in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        owner = model.get_submodule(prefix)
        tags: list[str] = []
        if leaf in owner._parameters:
            param = owner._parameters[leaf]
            if param is not None and param.is_floating_point() and param.requires_grad:
                tags.append("TRAIN")
        elif tensor.is_floating_point():
            tags.append("FLOATBUF")
        else:
            tags.append("INTBUF")
        if isinstance(owner, _NORM_TYPES):
            tags.append(f"NORM:{type(owner).__name__}")
        if any(prefix == h or prefix.startswith(h + ".") for h in heads):
            tags.append("HEAD")
        manifest[key] = {
            "shape": list(tensor.shape),
            "dtype": wire_dtype(tensor),
            "tags": tags,
        }
    return manifest


def model_manifest(spec_name: str, args: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tensor manifest of a registry model; its output layer (`head`, if any) is tagged HEAD (FedPer)."""
    model = build_model(spec_name, args)
    return tensor_manifest(model, head=("head",) if hasattr(model, "head") else ())
