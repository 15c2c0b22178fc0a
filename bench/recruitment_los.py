"""Scheltjens et al.'s client recruitment on PhysioNet 2012 set-a: length of stay with a GRU over ~100 sites;
all vs sampled vs recruited clients (Federated-AC, -SC, -ARC, -SRC) and a gamma_th sweep.

    python bench/recruitment_los.py --data DIR --sites 100 --rounds 15 --out runs/recruitment

DIR holds PhysioNet 2012 set-a (the `physionet2012` data format).

Everything runs in simulation (`run_simulation`: the real PS and site agents over an in-memory broker).
The held-out test set is the union of every site's own test split (recruited or not): each run's final
model is evaluated on all of them with `fedmqtt report`'s held-out union
(fedmqtt.experiments.heldout.union_table), pooled over stays (MAE, MAPE, MSE and MSLE are means over stays,
so pooling weighs each site by its test size) and as the unweighted per-site mean, next to the constant
predictor (the pooled training mean for every stay) on the same stays.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmqtt.data.partitioners import PartitionSpec, label_histograms, partition, write_partition_manifest  # noqa: E402
from fedmqtt.data.registry import labels_digest, load_dataset  # noqa: E402
from fedmqtt.data.spec import DataSpec  # noqa: E402
from fedmqtt.recruitment import LOS_EDGES, los_histogram, recruit  # noqa: E402
from fedmqtt.simulation import SimulationConfig, run_simulation  # noqa: E402
from schemas.messages import ModelSpec, TrainSettings  # noqa: E402

MODEL = ModelSpec(name="gru", args={"n_features": 37, "hidden": 32, "layers": 2, "dropout": 0.05,
                                    "static_features": 8})
TRAIN = TrainSettings(epochs=4, batch_size=128, lr=0.005, optimizer="adamw", weight_decay=0.005, loss="msle")
VARIANTS = {"AC": ("all", None), "SC": ("fraction", 0.1), "ARC": ("recruited", None), "SRC": ("recruited", 0.1)}


def make_sites(args: argparse.Namespace) -> tuple[dict[str, DataSpec], dict[str, list[int]], dict[str, int]]:
    """Dirichlet label skew over the ten LoS bins (stays without a LoS left out), one manifest."""
    base = DataSpec(format="physionet2012", path=(args.data / "set-a").resolve(),
                    options={"target": "los", "cache_dir": str((args.out / "cache").resolve())})
    ds = load_dataset(base)
    labelled = np.flatnonzero(np.isfinite(ds.y))
    bins = np.searchsorted(np.asarray(LOS_EDGES), ds.y[labelled], side="right")
    spec = PartitionSpec(kind="label_skew", n_sites=args.sites, alpha=args.alpha, seed=args.seed)
    parts = [labelled[p] for p in partition(spec, bins)]
    parts = [p for p in parts if len(p) >= 10]  # a site needs rows for train/val/test
    names = [f"h{i:03d}" for i in range(len(parts))]
    manifest = (args.out / "partition.json").resolve()
    hist = label_histograms(ds.y, parts)
    source = {"format": base.format, "path": str(base.path), "options": dict(base.options), "n_items": len(ds),
              "labels_sha256": labels_digest(ds.y)}
    write_partition_manifest(manifest, spec, parts, hist, source, site_names=names)
    sites = {n: base.model_copy(update={"partition": manifest, "site": n}) for n in names}
    histograms = {n: los_histogram(ds.y[p]) for n, p in zip(names, parts, strict=True)}
    return sites, histograms, {n: len(p) for n, p in zip(names, parts, strict=True)}


METRICS = ("mae", "mape", "mse", "msle")
CONSTANT = "constant"  # the key of the constant predictor's row in the scores


Scores = dict[str, dict[str, float | None]]  # run folder name or CONSTANT -> metric -> value


def held_out_scores(runs: list[Path], sites: dict[str, DataSpec]) -> tuple[Scores, int]:
    """Each run's final model on every site's test split (the held-out union of `fedmqtt report`), pooled
    over stays and per-site mean, and the constant predictor (the pooled training mean, from the runs'
    report.json `baseline`) on the same stays: ({run folder name or CONSTANT: {metric, metric_site_mean}},
    number of test stays)."""
    from fedmqtt.experiments.heldout import union_table
    from fedmqtt.experiments.runs import load_runs

    records = load_runs(runs)
    out: Scores = {}
    patients = 0
    for metric in METRICS:
        table = union_table(records, metric, sites)
        patients = table.patients
        for row in table.rows:
            key = CONSTANT if row.trained_on == "-" else row.label
            entry = out.setdefault(key, {})
            entry[metric] = row.pooled
            entry[f"{metric}_site_mean"] = row.site_mean.mean
    return out, patients


def run_variant(name: str, args, sites, gamma_th: float) -> dict:  # noqa: ANN001
    selection, fraction = VARIANTS[name]
    out = args.out / f"{name}-th{gamma_th}"
    cfg = SimulationConfig(run_id=f"recruitment-{name.lower()}", rounds=args.rounds, seed=args.seed, out_dir=out,
                           model=MODEL, train=TRAIN, sites=sites, selection=selection, fraction=fraction,
                           recruitment={"gamma_th": gamma_th}, selection_metric="msle")
    t0 = time.time()
    report = run_simulation(cfg, progress=False)
    wall = time.time() - t0
    rec = report.get("recruitment") or {}
    return {"variant": name, "gamma_th": gamma_th, "recruited": len(rec.get("recruited", [])) or len(sites),
            "wall_s": wall, "run": out.name, "level": (report.get("baseline") or {}).get("level")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("../shared/datasets/physionet2012"))
    ap.add_argument("--sites", type=int, default=100)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gamma-th", type=float, default=0.1)
    ap.add_argument("--sweep", default="0.05,0.1,0.2,0.3,0.5,1.0")
    ap.add_argument("--out", type=Path, default=Path("runs/recruitment"))
    ap.add_argument("--sweep-train", action="store_true", help="also train ARC at every gamma_th of the sweep")
    ap.add_argument("--skip-variants", action="store_true", help="only the sweep")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sites, hists, sizes = make_sites(args)
    print(f"{len(sites)} sites, {sum(sizes.values())} stays; sizes {min(sizes.values())}..{max(sizes.values())}")
    rows = [] if args.skip_variants else [run_variant(v, args, sites, args.gamma_th) for v in VARIANTS]
    sweep = []
    for th in [float(x) for x in args.sweep.split(",")]:
        r = recruit(hists, sizes, gamma_th=th)
        entry = {"gamma_th": th, "recruited": len(r.recruited)}
        if args.sweep_train:
            entry.update(run_variant("ARC", args, sites, th))
        sweep.append(entry)
    trained = [e for e in rows + sweep if "run" in e]
    runs = sorted({args.out / e["run"] for e in trained})
    scores, n_test = held_out_scores(runs, sites) if trained else ({}, 0)
    for e in trained:
        e.update(scores[e["run"]])
    constant = None
    if CONSTANT in scores:
        levels = {e["level"] for e in trained}
        constant = {"variant": "constant (pooled training mean)",
                    "level": levels.pop() if len(levels) == 1 else None, **scores[CONSTANT]}
    results = args.out / ("sweep.json" if args.skip_variants else "results.json")
    results.write_text(json.dumps({"variants": rows, "constant": constant, "sweep": sweep}, indent=2))
    print(f"held-out union: every site's test split, {len(sites)} sites, {n_test} stays; pooled over stays "
          "(per-site mean in brackets)")
    print("| variant | gamma_th | sites trained | MAE | MAPE | MSE | MSLE | wall s |")
    print("|---|---|---|---|---|---|---|---|")

    def cells(e: dict) -> str:
        def fmt(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.3f}"

        return " | ".join(f"{fmt(e[m])} ({fmt(e[m + '_site_mean'])})" for m in METRICS)

    for r in rows:
        print(f"| {r['variant']} | {r['gamma_th']} | {r['recruited']} | {cells(r)} | {r['wall_s']:.0f} |")
    if constant is not None:
        level = "" if constant["level"] is None else f" {constant['level']:.2f} days"
        print(f"| constant{level} | - | - | {cells(constant)} | - |")
    print("gamma_th sweep (recruited sites): " + ", ".join(f"{s['gamma_th']}: {s['recruited']}" for s in sweep))
    for s in sweep:
        if "mae" in s:
            print(f"  ARC gamma_th={s['gamma_th']}: {s['recruited']} sites, {cells(s)}, {s['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
