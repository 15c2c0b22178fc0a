"""A seeded random split of rows into kept and held-out, stratified by class or not, in numpy alone.

It draws the same rows as scikit-learn's `train_test_split(..., test_size=fraction, random_state=seed,
stratify=...)` (the function every site used before; tests/unit/test_shuffle_split.py compares the two on
random inputs), so every split recorded so far stays the same. It exists because importing scikit-learn costs
a site process about a CPU second (it imports scipy.stats and pandas), and a site needs nothing else from it.

The rule, stratified: the kept and held-out sizes are shared out over the classes in proportion to their
counts (floors first; the rows still to place go to the largest remainders, ties drawn at random), then each
class's rows are shuffled and cut. Unstratified: one shuffle of all rows, the first `n_held` are held out.
Both use one `numpy.random.RandomState(seed)` in the same order of draws as scikit-learn, which is what
makes the rows the same.
"""

from __future__ import annotations

import math

import numpy as np


def split_positions(n_rows: int, fraction: float, seed: int,
                    strata: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held) positions in `range(n_rows)`, `ceil(fraction * n_rows)` of them held out.

    Raises:
        ValueError: `fraction` is not in (0, 1), a side would be empty, or (stratified) a class has one row
            or a side would hold fewer rows than there are classes.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the held-out fraction must be in (0, 1), got {fraction}")
    n_held = math.ceil(fraction * n_rows)
    n_kept = n_rows - n_held
    if n_kept <= 0:
        raise ValueError(f"holding out {fraction} of {n_rows} rows leaves none to keep")
    rng = np.random.RandomState(seed)
    if strata is None:
        order = rng.permutation(n_rows)
        return order[n_held:n_held + n_kept], order[:n_held]
    return _stratified(np.asarray(strata), n_kept, n_held, rng)


def _stratified(strata: np.ndarray, n_kept: int, n_held: int,
                rng: np.random.RandomState) -> tuple[np.ndarray, np.ndarray]:
    classes, inverse = np.unique(strata, return_inverse=True)
    counts = np.bincount(inverse)
    if counts.min() < 2:
        raise ValueError(f"a class has {counts.min()} row (a stratified split needs at least 2 per class)")
    for side, size in (("kept", n_kept), ("held-out", n_held)):
        if size < classes.size:
            raise ValueError(f"the {side} side would hold {size} rows, fewer than the {classes.size} classes")
    by_class = np.split(np.argsort(inverse, kind="mergesort"), np.cumsum(counts)[:-1])
    kept_per_class = _share_out(counts, n_kept, rng)
    held_per_class = _share_out(counts - kept_per_class, n_held, rng)
    kept: list[np.ndarray] = []
    held: list[np.ndarray] = []
    for rows, k, h in zip(by_class, kept_per_class, held_per_class, strict=True):
        shuffled = rows.take(rng.permutation(rows.size), mode="clip")
        kept.append(shuffled[:k])
        held.append(shuffled[k:k + h])
    # The last two draws only order the sides; they are made so that the generator's state matches too.
    return rng.permutation(np.concatenate(kept)), rng.permutation(np.concatenate(held))


def _share_out(counts: np.ndarray, total: int, rng: np.random.RandomState) -> np.ndarray:
    """`total` rows over the classes in proportion to `counts`: floors, then the largest remainders, ties drawn
    at random (largest remainder first, each tie group drawn without replacement)."""
    exact = counts / counts.sum() * total
    share = np.floor(exact)
    left = int(total - share.sum())
    remainder = exact - share
    for value in np.sort(np.unique(remainder))[::-1]:
        if left <= 0:
            break
        (tied,) = np.nonzero(remainder == value)
        take = min(tied.size, left)
        share[rng.choice(tied, size=take, replace=False)] += 1
        left -= take
    return share.astype(np.int64)
