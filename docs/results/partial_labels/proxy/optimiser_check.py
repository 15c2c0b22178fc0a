"""The optimiser trial of the partial-label proxy, read on the validation split only (optimiser-check.toml).

For each run: the final model's (after two rounds) mean validation AUROC and masked BCE over the 8 sites, and
the range of the sites' AUROC. The test split is never read here: the choice must not look at it.
    python docs/results/partial_labels/proxy/optimiser_check.py runs/partial-labels-proxy/optimiser-check
"""
import json
import statistics
import sys
from pathlib import Path

folder = Path(sys.argv[1])
print("run                                      rounds  val AUROC mean (min-max of sites)  val loss mean")
for report_path in sorted(folder.glob("*/report.json")):
    report = json.loads(report_path.read_text())
    per_site = report["final"]["per_site"]
    auroc = [s["metrics"]["val"]["auroc"] for s in per_site.values() if s["metrics"]["val"].get("auroc") is not None]
    loss = [s["metrics"]["val"]["loss"] for s in per_site.values() if s["metrics"]["val"].get("loss") is not None]
    print(f"{report_path.parent.name:40s} {len(report['rounds']):6d}  {statistics.fmean(auroc):.3f} "
          f"({min(auroc):.3f}-{max(auroc):.3f}){'':17s}{statistics.fmean(loss):.4f}")
