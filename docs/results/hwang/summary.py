"""Hwang et al.'s protocol, summarised from finished grids: the method x norm table of the best-validation-round
model's test AUROC with bootstrap 95 % intervals, each method's norm chosen on VALIDATION (never test), FedPxN
against every other method at its chosen norm (paired Wilcoxon signed-rank by site x seed, Holm), the
paper's own unpaired test beside it, and a plot.

Run:  python docs/results/hwang/summary.py runs/hwang/heart docs/results/hwang/heart
      python docs/results/hwang/summary.py runs/hwang/stroke docs/results/hwang/stroke
Writes OUT/summary.md and OUT/summary.png.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np

from fedmqtt.experiments.paired import paired_rows, paired_table
from fedmqtt.experiments.runs import MEAN, POOLED_REFERENCE, RunRecord, load_runs, site_seed_matrix
from fedmqtt.experiments.stats import mean_interval

METRIC = "auroc"
FEDERATED = ("fedavg", "fedprox", "fedbn", "fedpxn", "fedadam", "fedadagrad", "fedyogi", "feddyn")
REFERENCES = ("central", "base")
NORMS = ("bn", "gn", "ln")


def validation_score(record: RunRecord) -> float:
    """The best round's mean validation AUROC over sites (what picked the round), from the run's report."""
    report = json.loads((record.path / "report.json").read_text())
    return float(report["best_round"]["score"])


def training_cpu_s(record: RunRecord) -> float:
    """CPU seconds the sites spent training, summed over rounds and sites (`usage.per_round` of the report):
    the cost stand-in on a machine without an energy meter (energy_j is null on CPU)."""
    report = json.loads((record.path / "report.json").read_text())
    return sum(float(site.get("cpu_s") or 0.0) for rnd in report.get("usage", {}).get("per_round", {}).values()
               for site in rnd.values())


def cell(records: list[RunRecord], sites: list[str]) -> tuple[float, float, tuple[float, float] | None]:
    """Mean and std over seeds of the site-average test AUROC, and the site-bootstrap 95 % interval."""
    seeds = sorted({r.seed for r in records})
    means = [v for r in records if (v := r.value("best", MEAN, METRIC)) is not None]
    interval = mean_interval(site_seed_matrix(records, sites, seeds, "best", METRIC))
    return statistics.fmean(means), statistics.stdev(means) if len(means) > 1 else 0.0, interval


def fmt(mean: float, std: float, interval: tuple[float, float] | None) -> str:
    ci = "" if interval is None else f" [{interval[0]:.3f}, {interval[1]:.3f}]"
    return f"{mean:.3f} ± {std:.3f}{ci}"


def main(grid: Path, out: Path) -> None:
    from scipy.stats import mannwhitneyu

    records = load_runs([grid])
    sites = sorted({s for r in records for s in r.sites})
    seeds = sorted({r.seed for r in records})
    by = {(a, n): [r for r in records if r.algorithm == a and r.norm == n] for a in (*REFERENCES, *FEDERATED)
          for n in NORMS}
    by = {k: v for k, v in by.items() if v}
    lines = [f"# Hwang et al.'s protocol: {grid.name}", "",
             f"Test AUROC of the best-validation-round model, site-average, mean ± std over seeds {seeds} "
             "[95 % CI: percentile bootstrap resampling sites]; n runs per cell in parentheses when fewer "
             f"than {len(seeds)}. Sites: {', '.join(sites)}.", "",
             "| method | " + " | ".join(n.upper() for n in NORMS) + " | norm chosen on validation |",
             "|---|" + "---|" * (len(NORMS) + 1)]
    chosen: dict[str, str] = {}
    plotted: list[tuple[str, str, float, tuple[float, float] | None]] = []
    for alg in (*REFERENCES, *FEDERATED):
        if not any((alg, norm) in by for norm in NORMS):
            continue  # not in this grid
        cells = []
        scores = {}
        for norm in NORMS:
            recs = by.get((alg, norm), [])
            if not recs:
                cells.append("not run")
                continue
            mean, std, interval = cell(recs, sites)
            plotted.append((alg, norm, mean, interval))
            short = "" if len(recs) == len(seeds) else f" (n={len(recs)})"
            cells.append(fmt(mean, std, interval) + short)
            scores[norm] = statistics.fmean(validation_score(r) for r in recs)
        if scores:
            chosen[alg] = max(scores, key=lambda n: scores[n])
        lines.append(f"| {alg} | " + " | ".join(cells) + f" | {chosen.get(alg, '-').upper()} |")
    pooled = [r for r in records if POOLED_REFERENCE in r.references]
    if pooled:
        first = {}
        for r in pooled:  # one per seed: the same data, so the same reference, for every algorithm of a seed
            first.setdefault(r.seed, r)
        per_seed = []
        for r in first.values():
            values = [v for s in r.sites if (v := r.references[POOLED_REFERENCE].get(s, {}).get(METRIC)) is not None]
            per_seed.append(statistics.fmean(values))
        lines.append(f"| (pooled reference: logistic regression) | {statistics.fmean(per_seed):.3f} ± "
                     f"{statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0:.3f} (no norm) | | |")
    lines += ["", "The best constant scores AUROC 0.5 at every site (no constant ranks patients).", ""]
    cost = {alg: statistics.fmean(training_cpu_s(r) for r in by[(alg, norm)]) for alg, norm in chosen.items()
            if alg in FEDERATED}
    if "fedbn" in cost:
        lines += ["Training CPU seconds per run (all sites, all rounds; mean over seeds, the validation-chosen "
                  "norm; the machine was shared, so only ratios within this table mean anything):", "",
                  "| " + " | ".join(cost) + " |", "|" + "---|" * len(cost),
                  "| " + " | ".join(f"{v:.2f} ({v / cost['fedbn']:.2f}x FedBN)" for v in cost.values()) + " |", ""]

    # FedPxN against every other federated method, each at the norm its validation score chose.
    picked = [r for r in records if r.algorithm in FEDERATED and chosen.get(r.algorithm) == r.norm]
    if any(r.algorithm == "fedpxn" for r in picked):
        (table,) = paired_table(picked, METRIC, which="best", versus="fedpxn")
        rows = paired_rows(table)
        rows[0].append("paper's test: rank-sum p on seed averages")
        fedpxn = [r.value("best", MEAN, METRIC) for r in picked if r.algorithm == "fedpxn"]
        for row, comparison in zip(rows[1:], table.comparisons, strict=True):
            other_alg = comparison.b.split("/")[0]
            other = [r.value("best", MEAN, METRIC) for r in picked if r.algorithm == other_alg]
            p = mannwhitneyu([v for v in fedpxn if v is not None], [v for v in other if v is not None],
                             alternative="two-sided").pvalue
            row.append(f"{p:.3g}")
        lines += ["FedPxN at its validation-chosen norm against every other method at its own "
                  f"({table.family}, Holm over {len(table.comparisons)}); pairs are (site, seed):", "",
                  "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
                  *("| " + " | ".join(r) + " |" for r in rows[1:]), "",
                  "* Holm p < 0.05. The last column is the paper's own test (Wilcoxon rank-sum = Mann-Whitney U, "
                  "two-sided, on the per-seed site-averages, unpaired, uncorrected), for comparison only."]
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    plot(plotted, out / "summary.png", grid.name)
    print("\n".join(lines))


def plot(points: list[tuple[str, str, float, tuple[float, float] | None]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algs = list(dict.fromkeys(p[0] for p in points))
    fig, ax = plt.subplots(figsize=(9, 4))
    for k, norm in enumerate(NORMS):
        xs, ys, lo, hi = [], [], [], []
        for alg, n, mean, interval in points:
            if n != norm:
                continue
            xs.append(algs.index(alg) + (k - 1) * 0.25)
            ys.append(mean)
            lo.append(mean - (interval[0] if interval else mean))
            hi.append((interval[1] if interval else mean) - mean)
        ax.errorbar(xs, ys, yerr=np.array([lo, hi]), fmt="o", capsize=3, label=norm.upper())
    ax.set_xticks(range(len(algs)), algs, rotation=30)
    ax.set_ylabel("test AUROC, site-average (95 % CI, sites resampled)")
    ax.set_title(f"{title}: best-validation-round model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
