"""Aggregation maths shared by the strategies (numpy only)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fedmqtt.strategies.base import SiteUpdate, Weights


def sample_weights(updates: Sequence[SiteUpdate]) -> np.ndarray:
    """p_i = n_i / sum n over the sites that reported (algorithms.md 0.1; uniform if every n_i is 0)."""
    counts = np.array([u.n_samples for u in updates], dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return np.full(len(updates), 1.0 / max(len(updates), 1))
    return counts / total


def weighted_mean(updates: Sequence[SiteUpdate], weights: np.ndarray, current: Weights) -> Weights:
    """Convex combination of every tensor in `current`; integer buffers take the maximum.

    Sums run in the order of `updates` (callers sort by site id) and in float64, so the result does
    not depend on message arrival order. Integer buffers (BN `num_batches_tracked`) are never
    averaged: the maximum over participants (algorithms.md 0.2 DECISION).
    """
    if not updates:
        return {name: value.copy() for name, value in current.items()}
    out: Weights = {}
    for name, reference in current.items():
        arrays = [np.asarray(u.tensors[name]) for u in updates]
        if np.issubdtype(reference.dtype, np.floating):
            acc = np.zeros(reference.shape, dtype=np.float64)
            for w, arr in zip(weights, arrays):
                acc += w * arr.astype(np.float64)
            out[name] = acc.astype(reference.dtype)
        else:
            out[name] = np.asarray(np.maximum.reduce(arrays), dtype=reference.dtype).reshape(reference.shape)
    return out


def check_update_shapes(update: SiteUpdate, current: Weights) -> str | None:
    """A reason why `update` cannot be combined with `current`, or None if it fits."""
    missing = sorted(set(current) - set(update.tensors))
    extra = sorted(set(update.tensors) - set(current))
    if missing or extra:
        return f"tensor names differ from the global model (missing {missing[:3]}, unexpected {extra[:3]})"
    for name, ref in current.items():
        got = update.tensors[name]
        if got.shape != ref.shape or got.dtype != ref.dtype:
            return f"tensor {name!r}: {got.dtype}{list(got.shape)} != global {ref.dtype}{list(ref.shape)}"
    return None
