"""The site's data loads through the agent's own path and matches its spec: rows per split, features, labels,
missing values. The same `load_site_data` the agent calls, so the check and training cannot disagree."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedmqtt.data.registry import Dataset, load_dataset
from fedmqtt.data.spec import DataSpec
from fedmqtt.errors import FedMqttError
from site_agent.data import load_site_data
from site_agent.preflight.findings import Finding, failed

DATA = "data"
SHOWN_COLUMNS = 3  # columns named in the missing-values summary


def check_data(spec: DataSpec) -> Finding:
    path = Path(spec.path)
    if not path.exists():
        return failed(DATA, f"{path}: no such file or folder",
                      f"Put this site's {spec.format} data at {path}, or correct path in the [data] table of the "
                      "site config (relative paths start at the config's folder).")
    try:
        raw = load_dataset(spec)
        site = load_site_data(spec, dataset=raw)  # the agent's path from here on
    except (FedMqttError, OSError, ValueError) as exc:
        return failed(DATA, str(exc).replace("\n", "; "),
                      "Make the file match the [data] spec (the message names the file, line and column), or "
                      "correct the spec (docs/data-preparation.md).")
    counts = {"train": site.n_train, "val": site.n_val, "test": site.n_test}
    histogram = site.label_histogram()
    names = site.task.label_names
    labels = ", ".join(f"{_label(names, key)}: {n}" for key, n in histogram.items())
    missing, values_each = _missing(raw)
    item = site.x_train.shape[1:]
    shape = f" ({'x'.join(str(n) for n in item)} values per item)" if len(item) > 1 else ""
    found = (f"{sum(counts.values())} rows ({counts['train']} train / {counts['val']} val / {counts['test']} test); "
             f"{len(site.feature_names)} features{shape}; train labels ({site.task.kind}) {labels}; "
             f"{_missing_text(missing)}{_implausible_text(site.out_of_range)}")
    facts = {"path": str(path), "format": spec.format, "rows": counts, "features": list(site.feature_names),
             "item_shape": list(site.x_train.shape[1:]), "task": site.task.kind, "label_histogram": histogram,
             "missing_values": missing, "unlabelled_dropped": int(len(raw) - int(raw.labelled().sum())),
             "out_of_range": dict(site.out_of_range)}
    details = tuple(site.notes)
    if site.n_train == 0:
        return Finding(DATA, "fail", found, "No training rows: the site cannot train. Check the file and the "
                       "[data] spec (label column, fractions).", details, facts)
    empty = [split for split, n in counts.items() if n == 0]
    if empty:
        return Finding(DATA, "warn", found, f"No {' or '.join(empty)} rows: this site's "
                       f"{'/'.join(empty)} metrics will be missing. More rows, or other fractions in [data].",
                       details, facts)
    if site.task.kind in ("binary", "multiclass") and sum(n > 0 for n in histogram.values()) < 2:
        return Finding(DATA, "warn", found, "Only one class in the training split: local training learns a "
                       "constant. Check the label column and the classes of the spec.", details, facts)
    whole = [name for name, n in missing.items() if n == values_each]
    if whole:
        return Finding(DATA, "warn", found, f"Never recorded here: {', '.join(whole)}; these features are 0 for "
                       "this site. Check the export of those columns.", details, facts)
    return Finding(DATA, "pass", found, "", details, facts)


def _missing(raw: Dataset) -> tuple[dict[str, int], int]:
    """Missing (NaN) values per feature in the file as read, before the train median fills them, and the
    number of values each feature has (rows, times hours for ICU stays)."""
    x = raw.x
    if raw.layout not in ("table", "icu") or not np.issubdtype(x.dtype, np.floating):
        return {}, 0  # images and ECG records have no missing values
    cells = np.isnan(x).reshape(-1, x.shape[-1])  # tables (n, f), ICU stays (n, hours, f)
    per_feature = cells.sum(axis=0)
    return {name: int(n) for name, n in zip(raw.feature_names, per_feature, strict=True) if n}, cells.shape[0]


def _missing_text(missing: dict[str, int]) -> str:
    if not missing:
        return "no missing values"
    top = sorted(missing.items(), key=lambda kv: -kv[1])[:SHOWN_COLUMNS]
    more = f", +{len(missing) - SHOWN_COLUMNS} more" if len(missing) > SHOWN_COLUMNS else ""
    return (f"{sum(missing.values())} missing values in {len(missing)} features "
            f"({', '.join(f'{k} {v}' for k, v in top)}{more})")


def _implausible_text(removed: dict[str, int]) -> str:
    """How many of this site's values the plausible ranges set to missing (fedmqtt.data.plausible)."""
    if not removed:
        return ""
    top = sorted(removed.items(), key=lambda kv: -kv[1])[:SHOWN_COLUMNS]
    more = f", +{len(removed) - SHOWN_COLUMNS} more" if len(removed) > SHOWN_COLUMNS else ""
    return (f"; {sum(removed.values())} values outside the plausible range set to missing "
            f"({', '.join(f'{k} {v}' for k, v in top)}{more})")


def _label(names: tuple[str, ...], key: str) -> str:
    return names[int(key)] if key.isdigit() and int(key) < len(names) else key
