"""Every method against one reference method over all partitions of a grid at once, with 95 % intervals.

    python bench/across_partitions.py runs/stroke-30-5seeds --reference fedavg --metric auroc --out FILE.md

`fedmqtt report` compares methods within each partition. This pools the partitions: rows are (partition,
site), columns are seeds, and each method's difference from the reference is taken on the same (partition,
site, seed) cells. Per method: the mean difference (unweighted over rows and seeds) with a percentile bootstrap
interval resampling rows (the same draw in every seed: a site's values in different seeds are not
independent), the median difference with its interval, the Wilcoxon signed-rank p on the cells and Holm's
correction over the methods (fedmqtt.experiments.stats, as `fedmqtt report`). Only partitions where every
method has every seed are used; the others are listed as left out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmqtt.experiments.runs import group_by, load_runs, site_seed_matrix  # noqa: E402
from fedmqtt.experiments.stats import holm, mean_interval, paired  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--reference", default="fedavg")
    ap.add_argument("--metric", default="auroc")
    ap.add_argument("--which", choices=("final", "best"), default="final")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    records = load_runs(args.runs)
    seeds = sorted({r.seed for r in records})
    methods = sorted({r.algorithm for r in records})
    complete, left_out = [], []
    for partition, recs in sorted(group_by(records, lambda r: r.partition).items()):
        have = {(r.algorithm, r.seed) for r in recs}
        (complete if all((m, s) in have for m in methods for s in seeds) else left_out).append(partition)
    matrices: dict[str, list[np.ndarray]] = {m: [] for m in methods}
    for partition in complete:
        recs = [r for r in records if r.partition == partition]
        sites = sorted({s for r in recs for s in r.sites})
        for method, runs in group_by(recs, lambda r: r.algorithm).items():
            matrices[method].append(site_seed_matrix(runs, sites, seeds, args.which, args.metric))
    stacked = {m: np.vstack(v) for m, v in matrices.items() if v}
    ref = stacked[args.reference]
    rows = []
    for method in [m for m in methods if m != args.reference]:
        diff = stacked[method] - ref
        pair = paired(stacked[method], ref)
        rows.append((method, float(np.nanmean(np.nanmean(diff, axis=0))), mean_interval(diff), pair))
    corrected = holm([r[3].p for r in rows])
    lines = [f"# Each method - {args.reference}, {args.which} test {args.metric}, pooled over partitions",
             "", f"Partitions ({len(complete)}): {', '.join(complete)}; seeds {seeds}; "
             f"{ref.shape[0]} (partition, site) rows." + (f" Left out (incomplete): {', '.join(left_out)}."
                                                         if left_out else ""), "",
             "| method | mean difference [95 % CI, rows resampled] | median difference [95 % CI] | cells | "
             "Wilcoxon p | Holm p | rank-biserial r |", "|---|---|---|---|---|---|---|"]

    def ci(iv: tuple[float, float] | None) -> str:
        return "n/a" if iv is None else f"[{iv[0]:+.3f}, {iv[1]:+.3f}]"

    for (method, mean, interval, pair), q in zip(rows, corrected, strict=True):
        star = "*" if q is not None and q < 0.05 else ""
        lines.append(f"| {method} | {mean:+.3f} {ci(interval)} | {pair.median:+.3f} {ci(pair.interval)} | {pair.n} | "
                     f"{pair.p:.3g} | {q:.3g}{star} | {pair.rank_biserial:+.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
