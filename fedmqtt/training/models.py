"""Model registry (name + args, never code) and the tensor manifest that tags state for the server."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from fedmqtt.errors import ConfigError

NORMS: tuple[str, ...] = ("none", "bn", "ln", "gn")
# Classified by module type (algorithms.md 0.2): names like "bn" in keys are never trusted.
_NORM_TYPES: tuple[type[nn.Module], ...] = tuple(
    t
    for t in (
        nn.modules.batchnorm._BatchNorm,  # BatchNorm1d/2d/3d, SyncBatchNorm, lazy variants
        nn.modules.instancenorm._InstanceNorm,
        nn.GroupNorm,
        nn.LayerNorm,
        getattr(nn, "RMSNorm", None),
    )
    if t is not None
)


class MLP(nn.Module):
    """Blocks of Linear -> norm -> ReLU -> dropout, then a Linear producing logits `(n, out_features)`."""

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
            if norm != "none":
                layers.append(_norm_layer(norm, size))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = size
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _check_mlp_args(
    in_features: Any, hidden: Any, out_features: Any, norm: Any, dropout: Any
) -> None:
    def positive_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if not positive_int(in_features):
        raise ConfigError(f"mlp: in_features must be a positive int, got {in_features!r}")
    if isinstance(hidden, (str, bytes)) or not all(positive_int(h) for h in hidden):
        raise ConfigError(f"mlp: hidden must be a list of positive ints, got {hidden!r}")
    if not positive_int(out_features):
        raise ConfigError(f"mlp: out_features must be a positive int, got {out_features!r}")
    if norm not in NORMS:
        raise ConfigError(f"mlp: norm must be one of {list(NORMS)}, got {norm!r}")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"mlp: dropout must be in [0, 1), got {dropout!r}")


def _norm_layer(norm: str, width: int) -> nn.Module:
    if norm == "bn":
        return nn.BatchNorm1d(width)
    if norm == "ln":
        return nn.LayerNorm(width)
    return nn.GroupNorm(gn_groups(width), width)


def gn_groups(width: int) -> int:
    """Groups for GroupNorm: at most 8, each of >= 4 channels where possible, dividing `width`."""
    # Groups of 1 channel would normalise every feature to 0 on (n, c) inputs.
    for groups in range(min(8, width // 4), 1, -1):
        if width % groups == 0:
            return groups
    return 1


MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": MLP}


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
    """Shape, dtype and group tags of every state-dict key (algorithms.md 0.2).

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
