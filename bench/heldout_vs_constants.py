"""Each method of a grid against the metric-optimal constants on the held-out union, with 95 % intervals.

    python bench/heldout_vs_constants.py runs/los/grid runs/los/grid-d --metrics msle mae mse --out DIR

`fedmqtt report --held-out` scores every run's final model on the union of every site's test split
(recruited or not) beside the constants, one row per run; its paired tests compare methods with each other
on their own test sites. This asks the question Scheltjens et al.'s comparison rests on, per partition:
does each method beat the best constant for the metric on the same patients, and by how much?

- pooled over stays (each seed's metric over every test stay, then the mean over seeds): method - constant,
  with a percentile bootstrap interval resampling stays (the same draw for every seed, as a stay's errors in
  different seeds are not independent);
- per (site, seed) pair: the unweighted site mean of the difference with its interval resampling sites, the
  median difference with its interval, the Wilcoxon signed-rank p and Holm's correction over the partition's
  table (fedmqtt.experiments.stats, as `fedmqtt report`).

Negative differences are better for every metric here (errors). Writes DIR/vs_constants-WHICH.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmqtt.experiments.heldout import held_out_sites, report_constants, run_test_splits  # noqa: E402
from fedmqtt.experiments.runs import RunRecord, Which, group_by, load_runs  # noqa: E402
from fedmqtt.experiments.stats import CONFIDENCE, holm, mean_interval, paired  # noqa: E402
from fedmqtt.training.holdout import load_test_splits, predict_test_splits  # noqa: E402

N_RESAMPLES = 2000
STAY_ERRORS = {  # per-stay error whose mean over stays is the metric
    "msle": lambda y, p: (np.log1p(np.maximum(p, 0)) - np.log1p(y)) ** 2,
    "mae": lambda y, p: np.abs(p - y),
    "mse": lambda y, p: (p - y) ** 2,
}


def stay_errors(records: list[RunRecord], metric: str, splits: dict[str, Any], preds: dict[Path, dict[str, np.ndarray]],
                seeds: list[int]) -> np.ndarray:
    """(stays, seeds) errors of one method (NaN for a seed it lacks)."""
    y = np.concatenate([splits[s].y.reshape(-1) for s in splits])
    out = np.full((len(y), len(seeds)), np.nan)
    for rec in records:
        p = np.concatenate([preds[rec.path][s].reshape(-1) for s in splits])
        out[:, seeds.index(rec.seed)] = STAY_ERRORS[metric](y, p)
    return out


def site_matrix(errors: np.ndarray, splits: dict[str, Any]) -> np.ndarray:
    """(sites, seeds): the metric at each site (mean of its stays' errors)."""
    bounds = np.cumsum([0, *(len(splits[s].y) for s in splits)])
    return np.stack([np.nanmean(errors[a:b], axis=0) if b > a else np.full(errors.shape[1], np.nan)
                     for a, b in zip(bounds[:-1], bounds[1:], strict=True)])


def stay_interval(diff: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """Percentile interval of the mean over seeds of each seed's mean difference, stays resampled."""
    n = diff.shape[0]
    stats = np.empty(N_RESAMPLES)
    for k in range(N_RESAMPLES):
        stats[k] = np.nanmean(np.nanmean(diff[rng.integers(0, n, n)], axis=0))
    tail = (1 - CONFIDENCE) / 2 * 100
    return float(np.percentile(stats, tail)), float(np.percentile(stats, 100 - tail))


WEIGHTS = {"final": "final_model.safetensors", "best": "best_model.safetensors"}


def compare(records: list[RunRecord], metrics: list[str], which: Which = "final") -> dict[str, Any]:
    sites = held_out_sites(records)
    splits = load_test_splits(sites)
    preds = {}
    federated: dict[str, dict[str, Any]] = {}  # runs with federated feature statistics read their test splits so
    for rec in records:
        report = json.loads((rec.path / "report.json").read_text())
        if (rec.path / WEIGHTS[which]).is_file():  # central runs keep no weights: their own per-site metrics
            preds[rec.path] = predict_test_splits(report["config"]["model"], rec.path / WEIGHTS[which],
                                                  run_test_splits(rec.path, sites, splits, federated))
    first = json.loads((records[0].path / "report.json").read_text())
    task = splits[next(iter(splits))].task
    constants = {c.label: c.constant for c in report_constants(first, task)}
    seeds = sorted({r.seed for r in records})
    methods = group_by(records, lambda r: r.algorithm)
    out: dict[str, Any] = {"which": which, "sites": len(splits), "stays": int(sum(len(s.y) for s in splits.values())),
                           "seeds": seeds, "metrics": {}}
    for metric in metrics:
        best_label, best = next((k, c) for k, c in constants.items() if metric in c.metrics)
        y = np.concatenate([splits[s].y.reshape(-1) for s in splits])
        const_err = np.repeat(STAY_ERRORS[metric](y, best.predict(len(y)).reshape(-1))[:, None], len(seeds), axis=1)
        const_sites = site_matrix(const_err, splits)
        rows = []
        for name, recs in methods.items():
            if any(r.path not in preds for r in recs):
                rows.append(own_sites_row(name, recs, metric, which, list(splits), seeds, const_sites))
                continue
            err = stay_errors(recs, metric, splits, preds, seeds)
            diff = err - const_err
            per_site = site_matrix(err, splits)
            pair = paired(per_site, const_sites)
            site_diff = per_site - const_sites
            rows.append({
                "method": name, "seeds": sorted(r.seed for r in recs),
                "pooled": float(np.nanmean(np.nanmean(err, axis=0))),
                "pooled_per_seed": [float(v) for v in np.nanmean(err, axis=0) if not np.isnan(v)],
                "pooled_diff": float(np.nanmean(np.nanmean(diff, axis=0))),
                "pooled_diff_ci": stay_interval(diff, np.random.default_rng(0)),
                "site_mean": float(np.nanmean(np.nanmean(per_site, axis=0))),
                "site_mean_diff": float(np.nanmean(np.nanmean(site_diff, axis=0))),
                "site_mean_diff_ci": mean_interval(site_diff),
                "pairs": pair.n, "median_diff": pair.median, "median_diff_ci": pair.interval,
                "wilcoxon_p": pair.p, "rank_biserial": pair.rank_biserial,
            })
        for row, q in zip(rows, holm([r["wilcoxon_p"] for r in rows]), strict=True):
            row["holm_p"] = q
        out["metrics"][metric] = {"constant": best.describe(), "label": best_label,
                                  "constant_pooled": float(np.nanmean(const_err[:, 0])),
                                  "constant_site_mean": float(np.nanmean(const_sites[:, 0])), "rows": rows}
    return out


def own_sites_row(name: str, recs: list[RunRecord], metric: str, which: Which, sites: list[str], seeds: list[int],
                  const_sites: np.ndarray) -> dict[str, Any]:
    """A method whose runs kept no weights (central): the site comparisons from each run's own per-site test
    metrics (every site, since it trained on all), no pooled-over-stays value."""
    per_site = np.full((len(sites), len(seeds)), np.nan)
    for rec in recs:
        for i, site in enumerate(sites):
            value = rec.value(which, site, metric)
            per_site[i, seeds.index(rec.seed)] = np.nan if value is None else value
    pair = paired(per_site, const_sites)
    site_diff = per_site - const_sites
    return {"method": name, "seeds": sorted(r.seed for r in recs), "pooled": None, "pooled_per_seed": [],
            "pooled_diff": None, "pooled_diff_ci": None,
            "site_mean": float(np.nanmean(np.nanmean(per_site, axis=0))),
            "site_mean_diff": float(np.nanmean(np.nanmean(site_diff, axis=0))),
            "site_mean_diff_ci": mean_interval(site_diff), "pairs": pair.n, "median_diff": pair.median,
            "median_diff_ci": pair.interval, "wilcoxon_p": pair.p, "rank_biserial": pair.rank_biserial,
            "note": "no weights kept: its own per-site test metrics"}


def num(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def fmt_ci(ci: Any) -> str:
    return "n/a" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def markdown(partition: str, result: dict[str, Any]) -> str:
    model = {"final": "final model", "best": "best-validation-round model"}[result["which"]]
    lines = [f"## {partition} ({model}): {result['sites']} sites, {result['stays']} held-out test stays, "
             f"seeds {', '.join(map(str, result['seeds']))}", ""]
    for metric, m in result["metrics"].items():
        lines += [f"### {metric.upper()} against the {m['constant']}", "",
                  f"Constant: pooled {m['constant_pooled']:.4g}, site mean {m['constant_site_mean']:.4g}.", "",
                  "| method | seeds | pooled (mean over seeds) | pooled - constant [95 % CI, stays resampled] | "
                  "site mean | site mean - constant [95 % CI, sites resampled] | median (site, seed) difference "
                  "[95 % CI] | pairs | Wilcoxon p | Holm p |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in m["rows"]:
            def p(v: float | None) -> str:
                return "n/a" if v is None else f"{v:.3g}"
            lines.append(
                f"| {r['method']} | {len(r['seeds'])} | {num(r['pooled'], '.4g')} | {num(r['pooled_diff'], '+.4g')} "
                f"{fmt_ci(r['pooled_diff_ci'])} | {r['site_mean']:.4g} | {r['site_mean_diff']:+.4g} "
                f"{fmt_ci(r['site_mean_diff_ci'])} | "
                f"{'n/a' if r['median_diff'] is None else format(r['median_diff'], '+.4g')} "
                f"{fmt_ci(r['median_diff_ci'])} "
                f"| {r['pairs']} | {p(r['wilcoxon_p'])} | {p(r['holm_p'])}{'*' if (r['holm_p'] or 1) < 0.05 else ''} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="grid folders or run folders")
    ap.add_argument("--metrics", nargs="+", default=["msle", "mae", "mse"], choices=sorted(STAY_ERRORS))
    ap.add_argument("--which", choices=sorted(WEIGHTS), default="final",
                    help="final: each run's final model; best: its best-validation-round model "
                    "(docs/algorithms.md 17.1)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    records = load_runs(args.runs)
    results, text = {}, ["# Every method against the metric-optimal constants (held-out union)", ""]
    for partition, recs in group_by(records, lambda r: r.partition).items():
        results[partition] = compare(recs, args.metrics, args.which)
        text.append(markdown(partition, results[partition]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"vs_constants-{args.which}.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / f"vs_constants-{args.which}.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
