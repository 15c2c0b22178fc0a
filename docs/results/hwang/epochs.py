"""Hwang et al.'s local-epoch finding: at a fixed budget of local epochs, 1 epoch x 40 rounds against 5 x 8
and 10 x 4 (BatchNorm), paired by (site, seed), Holm over the comparisons of the table.

Run:  python docs/results/hwang/epochs.py runs/hwang/heart runs/hwang/heart-epochs docs/results/hwang/heart
Writes OUT/epochs.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from fedmqtt.experiments.runs import RunRecord, load_runs, site_seed_matrix
from fedmqtt.experiments.stats import holm, mean_interval, paired, site_seed_mean

METRIC = "auroc"
ALGORITHMS = ("fedavg", "fedprox", "fedbn", "fedpxn")
SCHEDULES = (("1 x 40", ""), ("5 x 8", "-e5"), ("10 x 4", "-e10"))


def main(grid: Path, epochs_grid: Path, out: Path) -> None:
    records = [r for r in load_runs([grid]) if r.norm == "bn"] + load_runs([epochs_grid])
    sites = sorted({s for r in records for s in r.sites})
    seeds = sorted({r.seed for r in records})

    def matrix(label: str) -> np.ndarray:
        runs: list[RunRecord] = [r for r in records if r.algorithm == label]
        return site_seed_matrix(runs, sites, seeds, "best", METRIC)

    lines = ["# Local epochs at a fixed budget (heart disease, BatchNorm)", "",
             f"Test AUROC of the best-validation-round model, site-average over seeds {seeds} [95 % CI, sites "
             "resampled]; local epochs x rounds = 40 local epochs per site in every column.", "",
             "| method | " + " | ".join(s for s, _ in SCHEDULES) + " |", "|---|" + "---|" * len(SCHEDULES)]
    tests = []
    for alg in ALGORITHMS:
        cells = []
        for _, suffix in SCHEDULES:
            m = matrix(alg + suffix)
            mean, interval = site_seed_mean(m), mean_interval(m)
            cells.append("n/a" if mean is None else f"{mean:.3f}" + (
                "" if interval is None else f" [{interval[0]:.3f}, {interval[1]:.3f}]"))
            if suffix:
                tests.append((f"{alg} 1 x 40 - {alg}{suffix}", paired(matrix(alg), m)))
        lines.append(f"| {alg} | " + " | ".join(cells) + " |")
    adjusted = holm([t.p for _, t in tests])
    lines += ["", f"Paired by (site, seed), Wilcoxon signed-rank, Holm over {len(tests)}:", "",
              "| comparison | pairs | median difference [95 % CI] | rank-biserial r | p | Holm p |",
              "|---|---|---|---|---|---|"]
    for (name, t), q in zip(tests, adjusted, strict=True):
        ci = "" if t.interval is None else f" [{t.interval[0]:+.3f}, {t.interval[1]:+.3f}]"
        med = "n/a" if t.median is None else f"{t.median:+.3f}{ci}"
        r = "n/a" if t.rank_biserial is None else f"{t.rank_biserial:+.2f}"
        star = "*" if q is not None and q < 0.05 else ""
        p = "n/a" if t.p is None else f"{t.p:.3g}"
        lines.append(f"| {name} | {t.n} | {med} | {r} | {p} | {'n/a' if q is None else f'{q:.3g}'}{star} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "epochs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
