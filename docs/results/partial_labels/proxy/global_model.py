"""Each run's final global model (final_model.safetensors: what the PS holds, so FedBN's BatchNorm is the
pretrained one it started from, never averaged) on every site's test split, as Kulkarni et al.'s "FedBN
(Global)" rows. The per-site tables of `fedmqtt report` score FedBN with each site's own BatchNorm ("FedBN
(Local)"); for FedAvg and FedFBN both are the same model. Mean over the sites, then mean ± std over seeds.
    python docs/results/partial_labels/proxy/global_model.py runs/partial-labels-proxy/grid \
        runs/partial-labels-proxy/scratch
"""
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from fedmqtt.data.spec import DataSpec
from fedmqtt.metrics import task_metrics
from fedmqtt.training.holdout import load_test_splits, predict_test_splits

scores: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
for folder in map(Path, sys.argv[1:]):
    for point in sorted(folder.glob("*/grid_point.json")):
        run, doc = point.parent, json.loads(point.read_text())
        if not (run / "final_model.safetensors").is_file():
            continue
        sites = {s: DataSpec.model_validate(d) for s, d in doc["config"]["sites"].items()}
        splits = load_test_splits(sites)
        preds = predict_test_splits(doc["config"]["model"], run / "final_model.safetensors", splits)
        per_site = [task_metrics(splits[s].task, splits[s].y, preds[s])[0] for s in sorted(splits)]
        for metric in ("loss", "auroc"):
            values = [m[metric] for m in per_site if m.get(metric) is not None]
            scores[(doc["partition"], doc["algorithm"])][metric].append(statistics.fmean(values))
for (partition, algorithm), by_metric in sorted(scores.items()):
    cells = [f"{metric} {statistics.fmean(v):.3f} ± {statistics.stdev(v) if len(v) > 1 else 0:.3f} (n={len(v)})"
             for metric, v in by_metric.items()]
    print(f"{partition:32s} {algorithm:15s} global model, site mean: " + "; ".join(cells))
