"""Aggregation maths shared by the strategies (numpy only): weights, convex sums, buffer rules, groups."""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedmqtt.strategies.base import Manifest, SiteUpdate, Weights

# Participation weights: a float array or any sequence of floats, in the order of the updates.
Coefficients = Sequence[float] | np.ndarray


@dataclass(frozen=True)
class TensorGroups:
    """Shared tensor names split by how the server may treat them (docs/algorithms.md 0.2).

    `train` may go through optimizer-like rules (moments, corrections, control variates);
    `floatbuf` (float buffers, and frozen float parameters) only ever gets the convex weights;
    `intbuf` (integer buffers) is the maximum over participants.
    """

    train: list[str]
    floatbuf: list[str]
    intbuf: list[str]


def is_integer(array: np.ndarray) -> bool:
    """Integer and bool tensors are counters, never averaged."""
    return bool(np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_)


def split_groups(names: Iterable[str], manifest: Manifest, current: Weights) -> TensorGroups:
    """Classify `names` by their manifest tags.

    A name the manifest does not list falls back to its dtype (float: TRAIN, integer: INTBUF), so
    a plain model without buffers works with an empty manifest. A float tensor that is neither TRAIN
    nor a buffer (a frozen parameter) is treated like a float buffer: averaged, never transformed.
    """
    train: list[str] = []
    floatbuf: list[str] = []
    intbuf: list[str] = []
    for name in names:
        spec = manifest.get(name)
        if is_integer(current[name]) or (spec is not None and spec.is_intbuf):
            intbuf.append(name)
        elif spec is None or spec.is_train:
            train.append(name)
        else:
            floatbuf.append(name)
    return TensorGroups(train, floatbuf, intbuf)


def sample_weights(updates: Sequence[SiteUpdate]) -> np.ndarray:
    """p_i = n_i / sum n over the sites that reported (docs/algorithms.md 0.1; uniform if every n_i is 0)."""
    counts = np.array([u.n_samples for u in updates], dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return np.full(len(updates), 1.0 / max(len(updates), 1))
    return np.asarray(counts / total, dtype=np.float64)


def uniform_weights(count: int) -> np.ndarray:
    """1/|S_t| for each of `count` participants."""
    return np.full(count, 1.0 / max(count, 1))


def participant_weights(updates: Sequence[SiteUpdate], weighting: str) -> np.ndarray:
    """Renormalised participation weights: `samples` gives p_i, `uniform` gives 1/|S_t|."""
    return uniform_weights(len(updates)) if weighting == "uniform" else sample_weights(updates)


def population_weights(
    enrolled: Mapping[str, int], updates: Sequence[SiteUpdate], weighting: str
) -> dict[str, float]:
    """pi_i = n_i / n over every enrolled site (uniform: 1/N); unlisted participants count too."""
    sizes = {site: float(n) for site, n in enrolled.items()}
    for u in updates:
        sizes.setdefault(u.site_id, float(u.n_samples))
    total = sum(sizes[s] for s in sorted(sizes))
    if weighting == "uniform" or total <= 0:
        return {site: 1.0 / len(sizes) for site in sizes}
    return {site: n / total for site, n in sizes.items()}


_BLOCK = 1 << 20  # elements summed at a time: float64 scratch of 8 MB however big the tensor


def convex_combine(arrays: Iterable[np.ndarray], weights: Coefficients, like: np.ndarray) -> np.ndarray:
    """sum_i weights_i * arrays_i, accumulated in float64 in the given order, cast to `like`'s dtype.

    Summed block by block (each element still gets exactly the same additions in the same order), so a
    512 MB layer needs 16 MB of float64 scratch instead of two full-size float64 copies. The arrays are
    the PS's spooled memory maps: a block of each is read from the page cache when it is needed.
    """
    flats = [np.asarray(a).reshape(-1) for a in arrays]
    factors = [float(w) for w in weights]
    out = np.empty(like.shape, dtype=like.dtype)
    flat_out = out.reshape(-1)
    n = flat_out.size
    acc = np.empty(min(n, _BLOCK), dtype=np.float64)
    term = np.empty_like(acc)
    for start in range(0, n, _BLOCK):
        stop = min(n, start + _BLOCK)
        a, t = acc[: stop - start], term[: stop - start]
        a.fill(0.0)
        for w, flat in zip(factors, flats, strict=True):
            np.multiply(flat[start:stop], w, out=t, dtype=np.float64)
            a += t
            release_pages(flat, start, stop)
        flat_out[start:stop] = a  # the same cast as astype(like.dtype)
    return out


def release_pages(flat: np.ndarray, start: int, stop: int) -> None:
    """If `flat` maps a file (the PS's spooled updates), drop elements [start, stop) from this process's resident
    memory: the pages stay in the kernel's page cache and fault back in if read again. Without it every
    page read while summing stays mapped until the tensor is done, N sites' copies of a 512 MB layer at once."""
    owner: np.ndarray | None = flat
    while owner is not None and not isinstance(owner, np.memmap):
        owner = owner.base
    if owner is None:  # not a map: nothing to release
        return
    handle = getattr(owner, "_mmap", None)  # numpy keeps the mmap.mmap it maps here
    if handle is None or not hasattr(handle, "madvise") or flat.size == 0:
        return
    # Byte range within the mapping: numpy maps from the allocation boundary below the array's file offset.
    first = owner.offset % mmap.ALLOCATIONGRANULARITY + (flat.ctypes.data - owner.ctypes.data) + start * flat.itemsize
    begin = first - first % mmap.PAGESIZE
    end = min(len(handle), first + (stop - start) * flat.itemsize)
    if end > begin:
        handle.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def max_combine(arrays: Iterable[np.ndarray], like: np.ndarray) -> np.ndarray:
    """Integer buffers (BN `num_batches_tracked`): the maximum over participants.

    docs/algorithms.md 0.2, Decision 2.
    """
    out: np.ndarray | None = None
    for arr in arrays:
        out = np.array(arr, copy=True) if out is None else np.maximum(out, arr)
    if out is None:
        raise ValueError("max_combine of no arrays")
    return np.asarray(out, dtype=like.dtype).reshape(like.shape)


def combine(
    updates: Sequence[SiteUpdate], weights: Coefficients, names: Iterable[str], current: Weights
) -> Weights:
    """Convex combination of the float tensors `names`; integer tensors take the maximum."""
    out: Weights = {}
    for name in names:
        ref = current[name]
        # A generator: one site's tensor is read at a time (the PS keeps updates on disk, not in RAM).
        arrays = (u.tensors[name] for u in updates)
        out[name] = max_combine(arrays, ref) if is_integer(ref) else convex_combine(arrays, weights, ref)
    return out


def mean_delta(
    updates: Sequence[SiteUpdate], weights: Coefficients, name: str, current: Weights
) -> np.ndarray:
    """sum_i weights_i * (w_i - w_t) for one tensor, in float64 (the FedOpt/SCAFFOLD pseudo-gradient)."""
    ref = np.asarray(current[name], dtype=np.float64)
    acc = np.zeros(ref.shape, dtype=np.float64)
    for w, u in zip(weights, updates, strict=True):
        acc += float(w) * (np.asarray(u.tensors[name], dtype=np.float64) - ref)
    return acc


def copy_weights(weights: Mapping[str, np.ndarray]) -> Weights:
    """Fresh copies, so callers never share arrays with the strategy's state."""
    return {name: np.array(value, copy=True) for name, value in weights.items()}


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


def require_extra(update: SiteUpdate, key: str, algorithm: str) -> object:
    """The uplink extra `key` of `update`, or ValueError naming site and field (a protocol error)."""
    if key not in update.extras:
        raise ValueError(f"{algorithm}: update from {update.site_id!r} lacks extras[{key!r}]")
    return update.extras[key]
