"""Constant baseline for the partial-labels grid: every label's pooled training prevalence (annotated
rows only, add-one smoothed: fedmqtt.baselines) predicted for every record; test loss per site as the
sites compute it, per partition seed. (The first version used the unsmoothed np.nanmean, 0 for a label
without an annotated positive; constant-baseline.txt and the README's table come from that version.)"""
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from fedmqtt.baselines import smoothed_prevalence
from fedmqtt.data.registry import load_site_data
from fedmqtt.data.spec import DataSpec
from fedmqtt.metrics import task_metrics

grid = Path(sys.argv[1])
seen, losses = set(), {}
for point in sorted(grid.glob("*/grid_point.json")):
    doc = json.loads(point.read_text())
    sites = {s: DataSpec.model_validate(d) for s, d in doc["config"]["sites"].items()}
    key = str(next(iter(sites.values())).partition)
    if key in seen:
        continue
    seen.add(key)
    data = {s: load_site_data(spec) for s, spec in sorted(sites.items())}
    prev = smoothed_prevalence(np.concatenate([d.y_train for d in data.values()]))
    print(key, "prevalence", np.round(prev, 3).tolist())
    for s, d in data.items():
        ann = [k for k in range(d.y_train.shape[1]) if not np.isnan(d.y_train[:, k]).all()]
        m, _ = task_metrics(d.task, d.y_test, np.tile(prev, (len(d.y_test), 1)))
        losses.setdefault(s, []).append(m["loss"])
        print(" ", s, "annotates", ann, "train/val/test", len(d.y_train), len(d.y_val), len(d.y_test),
              "test positives", np.nansum(d.y_test, axis=0).astype(int).tolist(), "loss", round(m["loss"], 3))
means = [statistics.fmean(v) for v in zip(*losses.values(), strict=True)]  # every site in every seed
print("constant baseline test loss per site:",
      {s: f"{statistics.fmean(v):.3f} ± {statistics.stdev(v):.3f}" for s, v in losses.items()},
      "site mean", f"{statistics.fmean(means):.3f} ± {statistics.stdev(means):.3f}")
