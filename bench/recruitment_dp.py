"""Recruitment under DP: how Scheltjens et al.'s recruited set, and the model trained on it, change when each
site releases its label histogram with Gaussian noise at epsilon (the site policy's `label_histogram_epsilon`,
fedmqtt/training/histogram_dp.py). PhysioNet 2012 set-a, length of stay, ~94 sites by Dirichlet label skew, as
bench/recruitment_los.py builds them.

    python bench/recruitment_dp.py --out runs/recruitment_dp                  # the recruited sets only
    python bench/recruitment_dp.py --out runs/recruitment_dp --train          # and a model per (epsilon, seed)

For every epsilon, `--draws` independent noise draws (seeded here, so the numbers can be reproduced; a site draws
from the operating system) give the recruited set: its size, its Jaccard similarity with the set the exact
histograms recruit, and how often it is that set, each as a mean with a 95 % t-interval over the draws. The
noise is calibrated exactly as a site does (one release, L2 sensitivity 1, at --delta). The sample sizes n_c are
the exact ones: a site's status carries its record count unprotected, and the PS recruits with it.

With --train, draws 0..seeds-1 of each epsilon train on their recruited set (every recruited site every round,
FedAvg, training seed = the draw), and each final model is scored on the held-out union of every site's test
split (recruited or not), pooled over stays: mean and 95 % t-interval over the seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from recruitment_los import MODEL, held_out_scores, make_sites  # noqa: E402

from fedmqtt.recruitment import recruit  # noqa: E402
from fedmqtt.simulation import SimulationConfig, run_simulation  # noqa: E402
from fedmqtt.training.histogram_dp import noise_multiplier, noised_histogram  # noqa: E402
from schemas.messages import TrainSettings  # noqa: E402

TRAIN = TrainSettings(epochs=2, batch_size=128, lr=0.005, optimizer="adamw", weight_decay=0.005, loss="msle")


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % t-interval); half-width 0 for one value or no spread."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) < 2 or float(x.std()) == 0.0:
        return float(x.mean()), 0.0
    return float(x.mean()), float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))


def recruited_set(hists: dict[str, list[int]], sizes: dict[str, int], eps: float | None, delta: float,
                  rng: np.random.Generator, gamma_th: float) -> tuple[str, ...]:
    if eps is None:
        shared = {s: [float(c) for c in h] for s, h in hists.items()}
    else:
        std = noise_multiplier(eps, delta)  # L2 sensitivity 1: one stay is in one length-of-stay bin
        shared = {}
        for s, h in sorted(hists.items()):
            noised = noised_histogram({str(k): c for k, c in enumerate(h)}, std, rng)
            shared[s] = [float(noised[str(k)]) for k in range(len(h))]
    return recruit(shared, sizes, gamma_th=gamma_th).recruited


def paired(rows: list[dict]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per epsilon, each metric minus the exact-histogram run of the same training seed: mean and 95 % t-interval
    over the seeds (the seed's own variation cancels)."""
    base = next((row for row in rows if row["epsilon"] is None), None)
    if base is None:
        return {}
    by_seed = {r["seed"]: r for r in base["runs"]}
    return {str(row["epsilon"]): {m: interval([float(r[m]) - float(by_seed[r["seed"]][m]) for r in row["runs"]])
                                  for m in ("msle", "mae")} for row in rows if row["epsilon"] is not None}


def table(rows: list[dict], trained: bool) -> str:
    diffs = paired(rows) if trained else {}
    lines = ["| epsilon | noise std (records) | sites recruited | Jaccard with the exact set | same set |"
             + (" MSLE | MAE | MSLE - exact (paired) | MAE - exact (paired) |" if trained else ""),
             "|---|---|---|---|---|" + ("---|---|---|---|" if trained else "")]
    for row in rows:
        std = "-" if row["noise_std"] is None else f"{row['noise_std']:.2f}"
        line = (f"| {row['epsilon'] or 'none'} | {std} | {row['size'][0]:.1f} +- {row['size'][1]:.1f} | "
                f"{row['jaccard'][0]:.3f} +- {row['jaccard'][1]:.3f} | {row['same_set'][0]:.2f} +- "
                f"{row['same_set'][1]:.2f} |")
        if trained:
            d = diffs.get(str(row["epsilon"]))
            line += (f" {row['msle'][0]:.3f} +- {row['msle'][1]:.3f} | {row['mae'][0]:.2f} +- {row['mae'][1]:.2f} |"
                     + (f" {d['msle'][0]:+.3f} +- {d['msle'][1]:.3f} | {d['mae'][0]:+.2f} +- {d['mae'][1]:.2f} |"
                        if d else " - | - |"))
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("../shared/datasets/physionet2012"))
    ap.add_argument("--sites", type=int, default=100)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0, help="the partition's seed")
    ap.add_argument("--gamma-th", type=float, default=0.1)
    ap.add_argument("--epsilons", default="0.1,0.5,1,2,4,8,none")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("runs/recruitment_dp"))
    ap.add_argument("--summarise", type=Path, help="only print the table of this results.json")
    args = ap.parse_args()
    if args.summarise is not None:
        saved = json.loads(args.summarise.read_text())
        print(table(saved["rows"], trained=any(row["runs"] for row in saved["rows"])))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    sites, hists, sizes = make_sites(args)
    exact = set(recruited_set(hists, sizes, None, args.delta, np.random.default_rng(0), args.gamma_th))
    print(f"{len(sites)} sites, {sum(sizes.values())} stays; exact histograms recruit {len(exact)} sites")
    epsilons = [None if e == "none" else float(e) for e in args.epsilons.split(",")]
    rows, trained = [], {}
    for k, eps in enumerate(epsilons):
        sets = [recruited_set(hists, sizes, eps, args.delta, np.random.default_rng([k, d]), args.gamma_th)
                for d in range(args.draws)]
        jac = [len(exact & set(s)) / len(exact | set(s)) for s in sets]
        row = {"epsilon": eps, "noise_std": None if eps is None else noise_multiplier(eps, args.delta),
               "size": interval([float(len(s)) for s in sets]), "jaccard": interval(jac),
               "same_set": interval([float(set(s) == exact) for s in sets]), "runs": []}
        if args.train:
            for seed in range(args.seeds):
                chosen = sets[seed]
                key = (chosen, seed)
                if key not in trained:
                    out = args.out / f"eps{eps}-seed{seed}"
                    cfg = SimulationConfig(run_id="recruitment-dp", rounds=args.rounds, seed=seed, out_dir=out,
                                           model=MODEL, train=TRAIN, sites={s: sites[s] for s in chosen},
                                           selection_metric="msle")
                    t0 = time.time()
                    run_simulation(cfg, progress=False)
                    trained[key] = (out, time.time() - t0)
                row["runs"].append({"seed": seed, "sites": len(chosen), "run": str(trained[key][0]),
                                    "wall_s": trained[key][1]})
        rows.append(row)
        print(f"epsilon {eps}: size {row['size'][0]:.1f} +- {row['size'][1]:.1f}, jaccard "
              f"{row['jaccard'][0]:.3f} +- {row['jaccard'][1]:.3f}, same set {row['same_set'][0]:.2f}", flush=True)
    if args.train:
        runs = sorted({Path(r["run"]) for row in rows for r in row["runs"]})
        scores, n_test = held_out_scores(runs, sites)
        for row in rows:
            for r in row["runs"]:
                r.update(scores[Path(r["run"]).name])
            for metric in ("msle", "mae"):
                row[metric] = interval([float(r[metric]) for r in row["runs"]])
        print(f"held-out union: {n_test} stays of {len(sites)} sites")
    (args.out / "results.json").write_text(json.dumps({"exact_recruited": sorted(exact), "rows": rows,
                                                       "args": {k: str(v) for k, v in vars(args).items()}},
                                                      indent=2))
    print(table(rows, args.train))


if __name__ == "__main__":
    main()
