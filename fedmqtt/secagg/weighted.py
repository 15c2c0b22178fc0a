"""A sample-weighted mean as one masked sum: what a site puts into the ring, and how the PS reads the mean back.

FedAvg's w = sum_i n_i w_i / sum_i n_i needs two sums. Each site sends one vector: its float tensors, in sorted
name order and flattened, times p_i = n_i / weight_bound, followed by p_i itself. The PS removes the masks from
the sum of those vectors and divides the first part by the last coordinate. `weight_bound` is public (the PS
sends it with the task: the sum of the selected sites' enrolled sample counts), so p_i <= 1 for an honest count
and the products stay within the ring's clip whenever the tensors do; a site whose count exceeds the bound sends
p_i = 1 (its weight is capped, not wrapped).

A rule that also needs the sum of the sites' control-variate deltas (SCAFFOLD: c moves by sum_i n_i Delta_c_i / n)
gets them in the same vector (`Layout.variates`): after p_i, p_i times Delta_c_i for every float tensor in the same
order (zeros for a tensor without one), so B times that part of the sum is sum_i n_i Delta_c_i (`variates_from_sum`).

A rule that averages output rows label by label (FedFBN's surgical aggregation: row r is the mean over the sites
that annotate label r) gets per-label sums (`Layout.rows`, `Layout.labels`): in the tensors of `rows` (the output
layer, one row per label) row r is p_i m_r times the site's row, m_r = 1 when it annotates label r, else 0; after
everything else come the K per-label weights p_i m_r (`label_sums_from_sum`). Row r's mean is its sum over the
sum of the r-th weight; the other tensors' mean is read as before.

Integer tensors (BatchNorm's num_batches_tracked) are not averaged by any rule (the maximum is taken) and a sum
cannot give a maximum: they stay out of the masked vector (`split`), and the caller decides how they travel.

Error bound (docs/secure-aggregation.md, "Encoding"): with e = n / (2 scale) the rounding error of one coordinate
of the sum of n sites, and P = sum p_i the decoded total weight, each coordinate of the mean is off by at most
(e + |mean| e) / (P - e) against the mean of the clipped products.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedmqtt.secagg.ring import FixedPoint

FloatVector = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Layout:
    """Where each float tensor sits in the flat vector (sorted by name), with its shape and dtype."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    variates: bool = False  # the weighted control-variate deltas follow the weight (SCAFFOLD)
    normalised: bool = False  # the tensors over the site's local work, then three scalars, follow (FedNova)
    rows: tuple[str, ...] = ()  # tensors whose row r is weighted by label r (surgical output layer)
    labels: int = 0  # K: the rows of each of them, and the per-label weights at the end of the vector

    @property
    def floats(self) -> int:
        """Coordinates of the float tensors together (where the weight sits)."""
        return sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @property
    def length(self) -> int:
        """Coordinates of the masked vector: every float tensor's, one for the weight, then the variates' if any."""
        return self.floats * (1 + self.variates + self.normalised) + 1 + 3 * self.normalised + self.labels


def float_names(tensors: Mapping[str, np.ndarray]) -> list[str]:
    return sorted(n for n, v in tensors.items() if np.asarray(v).dtype.kind == "f")


def layout_of(tensors: Mapping[str, np.ndarray], *, variates: bool = False, normalised: bool = False,
              rows: tuple[str, ...] = ()) -> Layout:
    """The layout of `tensors`' float part (the model the PS sent: every site derives the same one); `rows` names
    the float tensors weighted label by label (each with the same K > 0 rows)."""
    if variates and normalised:
        raise ValueError("one rule sums either control-variate deltas or normalised updates, not both")
    if rows and (variates or normalised):
        raise ValueError("per-label rows are summed only next to the plain tensors")
    names = float_names(tensors)
    rows = tuple(sorted(set(rows)))
    if missing := [n for n in rows if n not in names]:
        raise ValueError(f"the per-label tensors {missing} are not float tensors of the model")
    heights = {int(np.shape(tensors[n])[0]) if np.ndim(tensors[n]) else 0 for n in rows}
    if rows and (len(heights) != 1 or min(heights) < 1):
        raise ValueError(f"the per-label tensors {list(rows)} must have one row per label, all the same number")
    return Layout(tuple(names), tuple(tuple(np.shape(tensors[n])) for n in names),
                  tuple(str(np.asarray(tensors[n]).dtype) for n in names), variates, normalised, rows,
                  heights.pop() if rows else 0)


def split(tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(float tensors, the rest): what is masked and summed, and what is not."""
    floats = set(float_names(tensors))
    return ({n: v for n, v in tensors.items() if n in floats}, {n: v for n, v in tensors.items() if n not in floats})


def site_weight(n_samples: int, weight_bound: float) -> float:
    """p_i = n_i / weight_bound, capped at 1."""
    if not (np.isfinite(weight_bound) and weight_bound > 0):
        raise ValueError(f"the weight bound must be a positive number, not {weight_bound}")
    return min(max(n_samples, 0) / weight_bound, 1.0)


def weighted_vector(tensors: Mapping[str, np.ndarray], layout: Layout, n_samples: int,
                    weight_bound: float, variates: Mapping[str, np.ndarray] | None = None,
                    work: tuple[float, float, float] | None = None,
                    label_mask: npt.ArrayLike | None = None) -> FloatVector:
    """What a site encodes and masks: p_i times its float tensors (in `layout`'s order), then p_i, then (when the
    layout has them) p_i times its control-variate deltas `variates` (zeros for a tensor without one), or, for a
    normalised layout with `work` = (a_i, tau_i, W), p_i / a_i times its float tensors, p_i a_i / W, p_i tau_i / W and
    p_i / a_i (the tensor and last parts 0 when a_i = 0: a site that took no step adds nothing to FedNova's
    direction). W is public (the PS's bound on local work): a site whose a_i or tau_i exceeds it is refused here,
    never clipped in silence. A layout with per-label rows needs `label_mask`, K values of 0 or 1 (1: this site
    annotates the label): row r of each of `layout.rows` is multiplied by it, and p_i times it ends the vector."""
    if layout_of(tensors, variates=layout.variates, normalised=layout.normalised, rows=layout.rows) != layout:
        raise ValueError("the update's float tensors do not match the round's layout (names, shapes or dtypes)")
    p = site_weight(n_samples, weight_bound)
    mask = np.zeros(0)
    if layout.labels:
        mask = np.asarray(label_mask if label_mask is not None else [], dtype=np.float64)
        if mask.shape != (layout.labels,) or not np.isin(mask, (0.0, 1.0)).all():
            raise ValueError(f"a layout with per-label rows needs a label mask of {layout.labels} zeros and ones")

    def weighted(name: str) -> FloatVector:
        array = np.asarray(tensors[name], dtype=np.float64)
        if name in layout.rows:
            array = array * mask.reshape((-1,) + (1,) * (array.ndim - 1))
        return array.ravel() * p

    parts = [weighted(n) for n in layout.names]
    parts.append(np.array([p]))
    if layout.variates:
        given = variates or {}
        for name, shape in zip(layout.names, layout.shapes, strict=True):
            delta = np.asarray(given.get(name, np.zeros(shape)), dtype=np.float64)
            if delta.shape != shape or not np.isfinite(delta).all():
                raise ValueError(f"the control-variate delta of {name} is not a finite array of shape {shape}")
            parts.append(delta.ravel() * p)
    if layout.normalised:
        if work is None or not all(np.isfinite(w) and w >= 0 for w in work) or not work[2] > 0:
            raise ValueError(f"a normalised layout needs the local work (a_i, tau_i, W), finite and >= 0, not {work}")
        a, steps, bound = work
        if max(a, steps) > bound:
            raise ValueError(f"the local work ({a:g}, {steps:g} steps) exceeds the round's bound W = {bound:g}")
        if 0 < a < 1:  # FedNova's forms give a_i >= 1 for any step taken: p_i / a_i must stay within the clip
            raise ValueError(f"the local work a_i = {a:g} is below 1, which no step of FedNova's forms gives")
        over = p / a if a > 0 else 0.0
        parts.extend(np.asarray(tensors[n], dtype=np.float64).ravel() * over for n in layout.names)
        parts.append(np.array([p * a / bound, p * steps / bound, over]))
    if layout.labels:
        parts.append(mask * p)
    return np.concatenate(parts)


def mean_from_sum(total: FloatVector, layout: Layout, weight_bound: float) -> tuple[dict[str, np.ndarray], int]:
    """The weighted mean of the float tensors (each back in its shape and dtype) and the total sample count the
    weights stand for, from the decoded sum of the sites' `weighted_vector`s. Raises ValueError when the total
    weight is not positive (no site with a sample survived)."""
    if total.shape != (layout.length,):
        raise ValueError(f"the sum has {total.shape} coordinates, the layout {layout.length}")
    weight = float(total[layout.floats])
    if not weight > 0:
        raise ValueError(f"the surviving sites' total weight is {weight}: nothing to average")
    mean: dict[str, np.ndarray] = {}
    at = 0
    for name, shape, dtype in zip(layout.names, layout.shapes, layout.dtypes, strict=True):
        size = int(np.prod(shape, dtype=np.int64))
        mean[name] = (total[at:at + size] / weight).reshape(shape).astype(dtype)
        at += size
    return mean, int(round(weight * weight_bound))


def variates_from_sum(total: FloatVector, layout: Layout, weight_bound: float) -> dict[str, np.ndarray]:
    """sum_i n_i Delta_c_i per float tensor (float64, in its shape) from the decoded sum of a layout with
    variates: B times the part after the weight. Each coordinate is off by at most B times the sum's rounding
    error (`FixedPoint.sum_error_bound`)."""
    if not layout.variates or total.shape != (layout.length,):
        raise ValueError("the sum carries no control-variate deltas (or has another length than the layout)")
    out: dict[str, np.ndarray] = {}
    at = layout.floats + 1
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        size = int(np.prod(shape, dtype=np.int64))
        out[name] = (total[at:at + size] * weight_bound).reshape(shape)
        at += size
    return out


def normalised_from_sum(total: FloatVector, layout: Layout, work_bound: float
                        ) -> tuple[float, dict[str, np.ndarray], float, float, float]:
    """From the decoded sum of a normalised layout: (sum p_i, sum p_i y_i / a_i per float tensor (float64, in its
    shape), sum p_i a_i, sum p_i tau_i, sum p_i / a_i); the two work sums are W times what the ring holds."""
    if not layout.normalised or total.shape != (layout.length,):
        raise ValueError("the sum carries no normalised updates (or has another length than the layout)")
    scaled: dict[str, np.ndarray] = {}
    at = layout.floats + 1
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        size = int(np.prod(shape, dtype=np.int64))
        scaled[name] = total[at:at + size].reshape(shape)
        at += size
    return (float(total[layout.floats]), scaled, float(total[at]) * work_bound, float(total[at + 1]) * work_bound,
            float(total[at + 2]))


def label_sums_from_sum(total: FloatVector, layout: Layout) -> tuple[FloatVector, dict[str, np.ndarray]]:
    """From the decoded sum of a layout with per-label rows: (the K per-label weights sum_i p_i m_r, each of
    `layout.rows` as sum_i p_i m_r row_r (float64, in its shape)). Row r's mean is the second over the first."""
    if not layout.labels or total.shape != (layout.length,):
        raise ValueError("the sum carries no per-label rows (or has another length than the layout)")
    rows: dict[str, np.ndarray] = {}
    at = 0
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        size = int(np.prod(shape, dtype=np.int64))
        if name in layout.rows:
            rows[name] = total[at:at + size].reshape(shape)
        at += size
    return total[layout.length - layout.labels:].copy(), rows


def mean_error_bound(fixed: FixedPoint, n_sites: int, total_weight: float, largest: float) -> float:
    """The most a coordinate of the decoded mean can be off (see the module text), for `n_sites` summed inputs,
    decoded total weight `total_weight` and the largest |coordinate| of the mean `largest`."""
    e = fixed.sum_error_bound(n_sites)
    if total_weight <= e:
        return float("inf")
    return (e + largest * e) / (total_weight - e)
