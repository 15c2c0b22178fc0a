"""The `baselines` section of a simulated run's report: what the model is measured against.

Only a simulation holds every site's data, so only it can score these on every site's splits:
- every metric-optimal constant (fedmqtt.baselines), fitted on the pooled training rows;
- the pooled reference model (fedmqtt.pooled_reference), tables only;
- the site-alone predictor: each site predicts its own training constant (per metric the one optimal for
  it). Where it beats both the pooled constant and the model, the site identity carries the label: the
  partition leaks it, and a federated model can look good by learning which site a row came from.
Warnings name every metric on which the model does not beat a constant, and a leaking partition.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fedmqtt.baselines import RANKING_METRICS, RANKING_NOTE, Constant, metric_optimal_constants
from fedmqtt.means import direction_of, mean_defined
from fedmqtt.pooled_reference import NotFitted, fit_pooled_reference

if TYPE_CHECKING:
    from fedmqtt.data.splits import SiteData

SPLITS = ("val", "test")
Scores = Callable[["SiteData", str], np.ndarray]  # (a site's data, split) -> scores for that split
LEAK = "the partition leaks the label"


def baselines_section(sites: Mapping[str, SiteData], model_test: Mapping[str, float | None], *, seed: int,
                      model_name: str = "the federated model") -> dict[str, Any]:
    """Constants, pooled reference and site-alone predictor scored on every site's val and test split
    (per site and the unweighted mean over sites), and warnings against `model_test`, the model's mean
    test metrics (report["final"]["mean"]["test"])."""
    data = dict(sorted(sites.items()))
    task = next(iter(data.values())).task
    y_pooled = np.concatenate([d.y_train for d in data.values()])
    constants = metric_optimal_constants(task, y_pooled)
    section: dict[str, Any] = {
        "fitted_on": f"the pooled training rows of {len(data)} sites ({len(y_pooled)} rows)",
        "constants": [{"metrics": list(c.metrics), "name": c.name, "formula": c.formula,
                       "value": np.asarray(c.value).tolist(), "what": c.describe(), **_score(data, _constant(c))}
                      for c in constants],
    }
    if task.kind != "regression":
        section["ranking_note"] = RANKING_NOTE
    first = next(iter(data.values())).x_train
    # Images and signals get no linear reference (fit_pooled_reference says why from an item's shape): their
    # training rows are not pooled only to be refused (OrganAMNIST's 26k images: an 83 MB copy, 0.2 s).
    pooled_x = np.concatenate([d.x_train for d in data.values()]) if first.ndim == 2 else first[:0]
    reference = fit_pooled_reference(task, pooled_x, y_pooled, seed=seed)
    if isinstance(reference, NotFitted):
        section["pooled_reference"] = {"fitted": False, "why": reference.why}
    else:
        section["pooled_reference"] = {"fitted": True, "what": reference.what,
                                       **_score(data, lambda d, split: reference.predict(getattr(d, f"x_{split}")))}
    section["site_alone"] = site_alone(data, constants)
    section["warnings"] = beat_warnings(model_test, section, model_name=model_name)
    return section


def _constant(constant: Constant) -> Scores:
    def scores(d: SiteData, split: str) -> np.ndarray:
        return constant.predict(len(getattr(d, f"y_{split}")))
    return scores


def _score(data: Mapping[str, SiteData], scores: Scores) -> dict[str, Any]:
    """Per site its val/test metrics (fedmqtt.metrics.task_metrics) and their unweighted means over sites."""
    from fedmqtt.metrics import task_metrics

    per_site = {site: {"metrics": {split: task_metrics(d.task, getattr(d, f"y_{split}"), scores(d, split))[0]
                                   for split in SPLITS}} for site, d in data.items()}
    return {"per_site": per_site, "mean": _means(per_site)}


def _means(per_site: Mapping[str, Any]) -> dict[str, dict[str, float | None]]:
    return {split: {k: mean_defined(e["metrics"][split].get(k) for e in per_site.values())
                    for k in sorted({k for e in per_site.values() for k in e["metrics"][split]})}
            for split in SPLITS}


def site_alone(data: Mapping[str, SiteData], pooled: list[Constant]) -> dict[str, Any]:
    """Each site predicts its own training constant; per metric, the constant optimal for that metric.

    Only the metrics some pooled constant targets are kept (a constant's AUROC is 0.5 at every site)."""
    from fedmqtt.metrics import task_metrics

    targets = {m for c in pooled for m in c.metrics}
    per_site: dict[str, Any] = {}
    for site, d in data.items():
        metrics: dict[str, dict[str, float | None]] = {split: {} for split in SPLITS}
        for own in metric_optimal_constants(d.task, d.y_train):
            for split in SPLITS:
                y = getattr(d, f"y_{split}")
                values = task_metrics(d.task, y, own.predict(len(y)))[0]
                metrics[split].update({m: values.get(m) for m in own.metrics if m in targets})
        per_site[site] = {"metrics": metrics}
    return {"what": "each site predicts its own training constant (per metric the one optimal for it)",
            "per_site": per_site, "mean": _means(per_site)}


def _better(a: float, b: float, metric: str) -> bool:
    return a > b if direction_of(metric) == "max" else a < b


def beat_warnings(model_test: Mapping[str, float | None], section: Mapping[str, Any], *,
                  model_name: str = "the federated model") -> list[str]:
    """One line per metric on which the model does not beat the pooled constant optimal for it, and one
    line when the site alone beats both that constant and the model (the partition leaks the label)."""
    out: list[str] = []
    best_constant: dict[str, float] = {}
    for c in section.get("constants", []):
        for m in c["metrics"]:
            base, model = c["mean"]["test"].get(m), model_test.get(m)
            if m in RANKING_METRICS or base is None:
                continue
            best_constant[m] = base
            if model is not None and not _better(model, base, m):
                out.append(f"{model_name} does not beat the constant for {c['name']} on test {m} "
                           f"(model {model:.4g}, constant {base:.4g}: {c['formula']})")
    leaks = []
    for m, alone in section.get("site_alone", {}).get("mean", {}).get("test", {}).items():
        model, base = model_test.get(m), best_constant.get(m)
        if alone is None or model is None or base is None:
            continue
        if _better(alone, model, m) and _better(alone, base, m):
            leaks.append(f"test {m}: site alone {alone:.4g}, model {model:.4g}, pooled constant {base:.4g}")
    if leaks:
        out.append(f"the site alone predicts the target better than {model_name} ({'; '.join(leaks)}): {LEAK}")
    return out


def legacy_baseline(section: Mapping[str, Any]) -> dict[str, Any] | None:
    """The single `baseline` entry older reports had (regression: the pooled training mean), for readers of
    report["baseline"]["level"]; None for classification. The report's tables read `baselines`."""
    mse = next((c for c in section.get("constants", []) if c["metrics"] == ["mse"]), None)
    if mse is None:
        return None
    return {"what": f"constant prediction, the pooled training mean {mse['value']:.4g} (best for MSE only)",
            "level": mse["value"], "per_site": mse["per_site"], "mean": mse["mean"]}
