"""A finished run's final model on sites' test splits, whether or not those sites trained it.

`fedmqtt report` uses this to compare a run that trained on recruited sites with one that trained on all
of them on the same patients: every site's own test split, prepared as the site prepares it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedmqtt.data.base import TaskInfo
from fedmqtt.data.spec import DataSpec


@dataclass(frozen=True)
class TestSplit:
    """One site's test split, normalised with that site's own training statistics."""

    x: np.ndarray
    y: np.ndarray
    task: TaskInfo


def load_test_splits(sites: dict[str, DataSpec]) -> dict[str, TestSplit]:
    """Every site's test split (loaded once, shared by all the runs being compared)."""
    from fedmqtt.data.registry import load_site_data

    out = {}
    for site, spec in sorted(sites.items()):
        data = load_site_data(spec)
        out[site] = TestSplit(x=data.x_test, y=data.y_test, task=data.task)
    return out


def predict_test_splits(model: dict[str, Any], weights: Path,
                        splits: dict[str, TestSplit]) -> dict[str, np.ndarray]:
    """The model (a ModelSpec as a dict: name, args) with `weights` (safetensors) on every test split,
    read as the sites read it (regression predictions clamped at 0, as site_agent's trainer does)."""
    import torch
    from safetensors.numpy import load_file

    from fedmqtt.training.evaluate import predict
    from fedmqtt.training.models import build_model
    from fedmqtt.training.weights import load_arrays

    torch.set_num_threads(1)
    net = build_model(model["name"], dict(model.get("args", {})))
    load_arrays(net, load_file(str(weights)))
    return {site: predict(net, s.x, s.task, nonnegative=s.task.kind == "regression")
            for site, s in splits.items()}
