"""Which labels a site's data annotate, for FedFBN's surgical output layer (Kulkarni et al., surgical aggregation).

Every site carries the union output layer (row r = label r). The PS averages row r over the sites that annotate
label r: in the clear each update names those rows (`ClientUpdate.label_set`), under secure aggregation each site
masks row r times 1 or 0 (site_agent/secagg_round.py). Both read the same mask, taken from the training data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def annotated_labels(kind: str, y_train: np.ndarray, labels: int) -> np.ndarray:
    """Which of the `labels` output rows this site's training data annotates (1.0) or not (0.0), for the
    surgical output layer: multi-label data marks a label it does not annotate with NaN in every record; for
    any other task kind every output row is its own (all ones, the plain mean)."""
    y = np.asarray(y_train, dtype=np.float64)
    if kind == "multilabel" and y.ndim == 2 and y.shape[1] == labels:
        return np.asarray((~np.isnan(y)).any(axis=0), dtype=np.float64)
    return np.ones(labels)


def label_set_for(per_label: Sequence[str], weights: Mapping[str, np.ndarray], kind: str,
                  y_train: np.ndarray) -> tuple[int, ...] | None:
    """The label set an update names when its task asks for one (`per_label`: the output tensors the PS averages
    label by label, one row per label): the rows of `annotated_labels`, increasing. None when the task asks for
    none, or names a tensor this model lacks or holds without rows (the PS then refuses the update, saying why)."""
    if not per_label:
        return None
    shapes = [np.shape(weights[name]) if name in weights else () for name in per_label]
    if any(len(shape) < 1 for shape in shapes) or len({shape[0] for shape in shapes}) != 1:
        return None
    return tuple(int(r) for r in np.flatnonzero(annotated_labels(kind, y_train, int(shapes[0][0]))))
