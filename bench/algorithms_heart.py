"""Every algorithm on the bundled heart-disease natural split (4 hospitals), simulated in-process.

    nice .venv/bin/python bench/algorithms_heart.py --rounds 20 --seed 0 --out runs/algorithms-heart

Runs `fedmqtt.simulation.run_simulation` once per algorithm of `fedmqtt.strategies.STRATEGIES`
but d-adafed and f-adafed (same code path as an MQTT deployment, CPU) and prints a Markdown
table of the final model's mean test AUROC and accuracy over the sites (unweighted, over sites
where defined), the best validation round and the wall time. The table is
also written to `<out>/table.md`, each run's report and models to `<out>/<algorithm>/`.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

# Runnable as a plain script from the repository root (bench/ is not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ps_daemon.runner  # noqa: E402,F401  (imported here so the first run's wall time excludes it)
import site_agent.agent  # noqa: E402,F401
from fedmqtt.simulation import DEFAULT_MODEL, DEFAULT_TRAIN, SimulationConfig, run_simulation  # noqa: E402
from fedmqtt.strategies import STRATEGIES  # noqa: E402
from schemas.messages import ModelSpec, TrainSettings  # noqa: E402

# SCAFFOLD option II and FedNova's ||a_i||_1 are defined for plain SGD; FedDyn
# prefers SGD. Everything else uses the simulation's default settings.
SGD_ALGORITHMS = ("scaffold", "feddyn", "fednova")
SGD_LR = 0.05
# d-AdaFed and f-AdaFed are left out; adafed runs (skip it with --no-adafed), its model pretrained
# in-simulation on a share of the pooled training rows (Chen et al.'s protocol).
ADAFED_FAMILY = ("adafed", "d-adafed", "f-adafed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: rounds, seed, output folder, model normalisation, algorithm subset."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="communication rounds per algorithm (default 20)")
    p.add_argument("--seed", type=int, default=0, help="run seed (default 0)")
    p.add_argument("--out", type=Path, default=Path("runs/algorithms-heart"), help="output folder")
    p.add_argument("--norm", choices=("bn", "none"), default="bn",
                   help="normalisation layers of the default MLP: bn (default; FedBN, FedPxN, FedFBN and "
                        "AdaFed act on them and equal FedAvg/FedProx without) or none (the simulation's "
                        "default model)")
    p.add_argument("--algorithms", nargs="*", default=None,
                   help="a subset (default: every registered algorithm but d-adafed and f-adafed)")
    p.add_argument("--no-adafed", action="store_true", help="leave adafed out of the default set")
    p.add_argument("--pretrain-fraction", type=float, default=0.2,
                   help="AdaFed: share of each site's training rows pooled to pretrain its model "
                        "(default 0.2)")
    return p.parse_args(argv)


def model_spec(norm: str) -> ModelSpec:
    """The simulation's default MLP with the chosen normalisation layers."""
    return ModelSpec(name=DEFAULT_MODEL.name, args={**dict(DEFAULT_MODEL.args), "norm": norm})


def train_settings(algorithm: str) -> TrainSettings:
    """SGD lr 0.05 for SCAFFOLD, FedDyn and FedNova; the simulation's defaults for every other rule."""
    if algorithm in SGD_ALGORITHMS:
        return DEFAULT_TRAIN.model_copy(update={"optimizer": "sgd", "lr": SGD_LR})
    return DEFAULT_TRAIN


def describe(settings: TrainSettings) -> str:
    return f"{settings.optimizer} lr {settings.lr:g}, {settings.epochs} epochs, batch {settings.batch_size}"


def run_one(algorithm: str, args: argparse.Namespace) -> dict[str, Any]:
    """Simulate one algorithm; the table row (or the reason it failed)."""
    extra: dict[str, Any] = {}
    if algorithm in ("adafed", "d-adafed"):
        extra["pretrain_fraction"] = args.pretrain_fraction
    config = SimulationConfig(run_id=f"bench-{algorithm}", algorithm=algorithm, rounds=args.rounds,
                              seed=args.seed, out_dir=args.out / algorithm, model=model_spec(args.norm),
                              train=train_settings(algorithm), **extra)
    # Each row independent of the rows before it: the in-simulation pretraining of AdaFed's model
    # draws its initial weights from the global RNG and runs with the process's thread count.
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        report = run_simulation(config, progress=False)
    except Exception as exc:  # one failing rule must not lose the others' results
        traceback.print_exc()
        return {"algorithm": algorithm, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:120],
                "seconds": time.perf_counter() - started}
    test = report["final"]["mean"].get("test", {})
    best = report.get("best_round") or {}
    return {"algorithm": algorithm, "auroc": test.get("auroc"), "accuracy": test.get("accuracy"),
            "best_round": best.get("round"), "best_val": best.get("score"),
            "seconds": time.perf_counter() - started}


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The results table plus the settings it was made with."""
    lines = ["| algorithm | mean test AUROC | mean test accuracy | best validation round | wall seconds |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['algorithm']} | failed: {r['error']} | | | {r['seconds']:.1f} |")
            continue
        best = "n/a" if r["best_round"] is None else f"{r['best_round']} (val AUROC {r['best_val']:.3f})"
        cells = [r["algorithm"], _num(r["auroc"]), _num(r["accuracy"]), best, f"{r['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    sgd = [r["algorithm"] for r in rows if r["algorithm"] in SGD_ALGORITHMS]
    notes = [
        "",
        f"UCI heart disease, natural split (4 hospitals), {args.rounds} rounds, seed {args.seed}, "
        f"`run_simulation` (in-process, CPU). Model: mlp {dict(model_spec(args.norm).args)}.",
        f"Local training: {describe(DEFAULT_TRAIN)} (simulation default) for every algorithm"
        + (f" except {', '.join(sgd)}: {describe(train_settings(sgd[0]))}." if sgd else "."),
        "Algorithm hyper-parameters: each strategy's defaults. Metrics: the final model on each site's "
        "held-out "
        "test split, unweighted mean over sites where defined. Best validation round: highest mean val AUROC "
        "of the received model (docs/algorithms.md 17.1).",
    ]
    if any(r["algorithm"] in ("adafed", "d-adafed") for r in rows):
        notes.append(f"AdaFed: model pretrained in-simulation on {args.pretrain_fraction:g} of each site's "
                     "training rows, pooled (Chen et al.'s protocol).")
    return "\n".join(lines + notes) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run every selected algorithm, print the table and write it to <out>/table.md."""
    args = parse_args(argv)
    names = args.algorithms or [a for a in STRATEGIES
                                if a not in ADAFED_FAMILY or (a == "adafed" and not args.no_adafed)]
    unknown = [a for a in names if a not in STRATEGIES]
    if unknown:
        print(f"unknown algorithm(s) {', '.join(unknown)}; available: {', '.join(STRATEGIES)}",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for algorithm in names:
        row = run_one(algorithm, args)
        status = row.get("error") or f"test auroc {_num(row['auroc'])}"
        print(f"{algorithm:<11} {status} ({row['seconds']:.1f} s)", file=sys.stderr, flush=True)
        rows.append(row)
    table = markdown(rows, args)
    (args.out / "table.md").write_text(table)
    print(table)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
