"""What a site hands secure aggregation under distributed DP (DP-FedAvg with the noise added by the sites,
fedmqtt/secagg/skellam.py): its model change, w_i - w_t, on every float tensor it shares. The clipping and the noise
come when it masks (site_agent/secagg_round.py), so the stored update (kept to resume after a restart) holds the
exact change and the same noise is drawn again from the round's kept secret."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def model_change(trained: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """w_i - w_t for every float tensor of `trained` (in its dtype); other tensors as trained (they are not summed).
    KeyError: a float tensor the starting model lacks (the change would be undefined)."""
    out: dict[str, np.ndarray] = {}
    for name, value in trained.items():
        array = np.asarray(value)
        if array.dtype.kind != "f":
            out[name] = array
            continue
        base = np.asarray(start[name], dtype=np.float64)
        if base.shape != array.shape:
            raise ValueError(f"{name}: the trained tensor has shape {array.shape}, the round's model {base.shape}")
        out[name] = (array.astype(np.float64) - base).astype(array.dtype)
    return out
