"""Seed 002 on PhysioNet 2012 set-a: length of stay with a GRU over ~100 sites; all vs sampled vs
recruited clients (Federated-AC, -SC, -ARC, -SRC) and a gamma_th sweep.

    python bench/seed002_los.py --data ../shared/datasets/physionet2012 --sites 100 --rounds 15 --out runs/seed002

Everything runs in simulation (`run_simulation`: the real PS and site agents over an in-memory broker).
The held-out test set is the union of every site's own test split (recruited or not): the final model
is evaluated on each and pooled (MAE, MAPE, MSE and MSLE are means over stays, so pooling weighs
each site by its test size).
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
from fedmqtt.data.registry import labels_digest, load_dataset, load_site_data  # noqa: E402
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
    return sites, {n: los_histogram(ds.y[p]) for n, p in zip(names, parts)}, {n: len(p) for n, p in zip(names, parts)}


def pooled_test(out: Path, sites: dict[str, DataSpec]) -> dict[str, float]:
    """The final model on every site's test split, pooled over stays."""
    import torch
    from safetensors.numpy import load_file

    from fedmqtt.data.base import TaskInfo
    from fedmqtt.training.evaluate import predict
    from fedmqtt.training.models import build_model
    from fedmqtt.training.weights import load_arrays
    from fedmqtt.metrics import regression_metrics

    model = build_model(MODEL.name, dict(MODEL.args))
    load_arrays(model, load_file(str(out / "final_model.safetensors")))
    ys, ps = [], []
    for spec in sites.values():
        d = load_site_data(spec)
        ys.append(d.y_test)
        ps.append(predict(model, d.x_test, TaskInfo("regression", 1), nonnegative=True))
    torch.set_num_threads(1)
    metrics, _ = regression_metrics(np.concatenate(ys), np.concatenate(ps))
    return {k: float(v) for k, v in metrics.items() if v is not None}


def run_variant(name: str, args, sites, gamma_th: float) -> dict:  # noqa: ANN001
    selection, fraction = VARIANTS[name]
    out = args.out / f"{name}-th{gamma_th}"
    cfg = SimulationConfig(run_id=f"seed002-{name.lower()}", rounds=args.rounds, seed=args.seed, out_dir=out,
                           model=MODEL, train=TRAIN, sites=sites, selection=selection, fraction=fraction,
                           recruitment={"gamma_th": gamma_th}, selection_metric="msle")
    t0 = time.time()
    report = run_simulation(cfg, progress=False)
    wall = time.time() - t0
    rec = report.get("recruitment") or {}
    return {"variant": name, "gamma_th": gamma_th, "recruited": len(rec.get("recruited", [])) or len(sites),
            "wall_s": wall, **pooled_test(out, sites)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("../shared/datasets/physionet2012"))
    ap.add_argument("--sites", type=int, default=100)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gamma-th", type=float, default=0.1)
    ap.add_argument("--sweep", default="0.05,0.1,0.2,0.3,0.5,1.0")
    ap.add_argument("--out", type=Path, default=Path("runs/seed002"))
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
    results = args.out / ("sweep.json" if args.skip_variants else "results.json")
    results.write_text(json.dumps({"variants": rows, "sweep": sweep}, indent=2))
    print("| variant | gamma_th | sites trained | MAE | MAPE | MSE | MSLE | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['gamma_th']} | {r['recruited']} | {r['mae']:.3f} | {r['mape']:.3f} | "
              f"{r['mse']:.2f} | {r['msle']:.4f} | {r['wall_s']:.0f} |")
    print("gamma_th sweep (recruited sites): " + ", ".join(f"{s['gamma_th']}: {s['recruited']}" for s in sweep))
    for s in sweep:
        if "mae" in s:
            print(f"  ARC gamma_th={s['gamma_th']}: {s['recruited']} sites, MAE {s['mae']:.3f}, MAPE {s['mape']:.3f}, "
                  f"MSE {s['mse']:.2f}, MSLE {s['msle']:.4f}, {s['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
