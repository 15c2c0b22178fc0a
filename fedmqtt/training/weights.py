"""Moving model state between torch modules and plain numpy arrays (what crosses the wire)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from fedmqtt.training.models import build_model


def state_to_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """CPU numpy copies of every state-dict tensor, sorted by key: float32 for floats, int64 otherwise."""
    out: dict[str, np.ndarray] = {}
    for key, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu")
        # Go through torch for the cast: numpy has no bfloat16.
        t = t.to(torch.float32) if t.is_floating_point() else t.to(torch.int64)
        out[key] = t.numpy().copy()
    return out


def load_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy `arrays` into `model`'s state in place, strictly.

    Raises:
        ValueError: a key is missing or unexpected, a shape differs, or a float array would go into
            an integer tensor (or the reverse); the message names the tensor.
    """
    state = model.state_dict()
    missing = sorted(set(state) - set(arrays))
    unexpected = sorted(set(arrays) - set(state))
    if missing or unexpected:
        raise ValueError(f"state mismatch: missing tensors {missing}, unexpected tensors {unexpected}")
    new_state: dict[str, torch.Tensor] = {}
    for key, target in state.items():
        array = np.asarray(arrays[key])
        if tuple(array.shape) != tuple(target.shape):
            raise ValueError(
                f"tensor {key!r}: shape {tuple(array.shape)} does not match the model's {tuple(target.shape)}"
            )
        is_float = np.issubdtype(array.dtype, np.floating)
        if is_float != target.is_floating_point() or not (is_float or np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"tensor {key!r}: dtype {array.dtype} cannot be loaded into {target.dtype}")
        new_state[key] = torch.from_numpy(np.array(array, copy=True)).to(target.dtype)
    model.load_state_dict(new_state, strict=True)


def initial_arrays(spec_name: str, args: Mapping[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Initial weights of a registered model, a pure function of (spec, args, seed).

    The model is built under a forked CPU RNG, so the caller's global torch RNG state is untouched.
    """
    with torch.random.fork_rng(devices=[]):
        # Seed only the CPU generator: torch.manual_seed would also (lazily) reseed CUDA outside the fork.
        torch.default_generator.manual_seed(seed)
        model = build_model(spec_name, dict(args))
    return state_to_arrays(model)
