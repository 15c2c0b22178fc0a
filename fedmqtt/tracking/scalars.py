"""What a tracked run logs, as plain names and numbers: the same for every backend (docs/tracking.md).

Names group by their first part, which TensorBoard turns into one section each: `val` (the mean validation
metrics, the charts people look at first), `val_site` (one series per site and metric), `train`, `round`;
and at the end `test`, `test_site`, `best_test`, `best`. Per-site series sit under their own prefix so that a
site may be called anything the schema allows, "mean" included, without colliding with a mean.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from schemas.messages import RoundMetrics

ParamValue = str | int | float | bool
# MLflow refuses longer parameter values on older servers; the whole config is logged as a file as well.
MAX_PARAM_CHARS = 500
# Logged once for every round, whatever the metrics: the steps a tracker holds it at are the rounds it has.
ROUND_MARK = "round/sites"


def round_scalars(metrics: RoundMetrics) -> dict[str, float]:
    """One closed round (what the PS publishes on ps/metrics): the validation metrics of the model the sites
    received, mean and per site, the mean training loss, the round's duration, and the accepted updates."""
    return _round(metrics.mean, metrics.per_site, train_loss=metrics.train_loss, duration_s=metrics.duration_s,
                  n_sites=len(metrics.sites), update_bytes=sum(metrics.update_bytes.values()) or None)


def report_round_scalars(entry: Mapping[str, Any]) -> dict[str, float]:
    """`round_scalars` of a round as report.json keeps it (`rounds[]`), which lacks the bytes: for rounds a
    tracker missed (the PS was killed before they were logged)."""
    return _round(entry.get("mean", {}), entry.get("per_site", {}), train_loss=entry.get("train_loss"),
                  duration_s=entry.get("duration_s"), n_sites=len(entry.get("sites", ())), update_bytes=None)


def _round(mean: Mapping[str, Any], per_site: Mapping[str, Mapping[str, Any]], *, train_loss: Any,
           duration_s: Any, n_sites: int, update_bytes: int | None) -> dict[str, float]:
    out: dict[str, float] = {}
    _put(out, "val", mean)
    for site, site_metrics in sorted(per_site.items()):
        for name, value in site_metrics.items():
            _put_one(out, f"val_site/{name}/{site}", value)
    _put_one(out, "train/loss", train_loss)
    _put_one(out, "round/duration_s", duration_s)
    out[ROUND_MARK] = float(n_sites)
    _put_one(out, "round/update_bytes", update_bytes)
    return out


def final_scalars(report: Mapping[str, Any]) -> dict[str, float]:
    """The run's report: the final model's test metrics (mean and per site), and where the run chose a best
    round, that round and the mean test metrics of each site's best-round model."""
    out: dict[str, float] = {}
    final = report.get("final", {})
    _put(out, "test", final.get("mean", {}).get("test", {}))
    for site, entry in sorted(final.get("per_site", {}).items()):
        for name, value in entry.get("metrics", {}).get("test", {}).items():
            _put_one(out, f"test_site/{name}/{site}", value)
    best = report.get("best") or {}
    _put(out, "best_test", best.get("mean", {}).get("test", {}))
    if best_round := report.get("best_round"):
        _put_one(out, "best/round", best_round.get("round"))
    return out


def final_step(report: Mapping[str, Any]) -> int:
    """The step the final metrics are logged at: the last closed round (0 for a run without rounds)."""
    rounds = report.get("rounds") or []
    return int(rounds[-1]["round"]) if rounds else 0


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, ParamValue]:
    """A config as flat `a.b.c` keys with scalar values (what MLflow params and TensorBoard hparams take):
    lists become JSON text, None becomes "none", long values are cut with "..." (the config file is logged
    whole beside them)."""
    out: dict[str, ParamValue] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, prefix=f"{name}."))
            continue
        if isinstance(value, bool | int | float) and not (isinstance(value, float) and not math.isfinite(value)):
            out[name] = value
            continue
        text = "none" if value is None else value if isinstance(value, str) else json.dumps(value, default=str)
        out[name] = text if len(text) <= MAX_PARAM_CHARS else text[:MAX_PARAM_CHARS - 3] + "..."
    return out


def _put(out: dict[str, float], prefix: str, metrics: Mapping[str, Any]) -> None:
    for name, value in metrics.items():
        _put_one(out, f"{prefix}/{name}", value)


def _put_one(out: dict[str, float], name: str, value: Any) -> None:
    """Undefined metrics (None: one class in the split...) and non-finite values are left out, not logged as 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return
    out[name] = float(value)
