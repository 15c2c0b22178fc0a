"""Privacy-utility curves on the bundled heart-disease federation (4 hospitals), with a membership-inference audit.

    nice .venv/bin/python bench/privacy_utility.py --seeds 0 1 2 --rounds 10 --out docs/results/privacy

For every epsilon in --epsilons and every seed, `fedmqtt.simulation.run_simulation` (the deployment's code path,
in process) trains FedAvg with
- record-level DP (`train.dp`: DP-SGD at every site, target_epsilon spread over the run's rounds), and
- participant-level DP (`algorithm = "dp-fedavg"`, fixed clip C, the noise multiplier that Opacus' RDP
  accountant says spends epsilon over the rounds with every site in every round, q = 1),
plus the same FedAvg without DP ("none"). Each run's final model is then attacked
(fedmqtt.privacy_audit: Yeom et al.'s loss threshold) at each site: members its training rows, non-members its
validation and test rows. The federated models barely overfit, so a second, deliberately overfit setting shows the
attack itself at work: one hospital's model (Cleveland) trained on --audit-members of its rows for 50 epochs,
with DP-SGD at each epsilon or without, attacked with its other rows as non-members.
With --audit-runs, only the attack, on the runs of a `fedmqtt grid` folder (docs/results/privacy/README.md).
Written to --out: results.json (every run), table.md (means over
seeds of the per-site means, with bootstrap intervals resampling sites, fedmqtt.experiments.stats) and
privacy_utility.png.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np

# Runnable as a plain script from the repository root (bench/ is not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmqtt.data.heart_disease import SITES  # noqa: E402
from fedmqtt.data.spec import DataSpec  # noqa: E402
from fedmqtt.experiments.stats import mean_interval, site_seed_mean  # noqa: E402
from fedmqtt.privacy_audit import binary_log_losses, membership_audit  # noqa: E402
from fedmqtt.simulation import DEFAULT_MODEL, SimulationConfig, run_simulation  # noqa: E402
from fedmqtt.simulation_config import bundled_sites  # noqa: E402
from schemas.messages import ModelSpec, RecordDP, TrainSettings  # noqa: E402

DELTA = 1e-5
CLIP = 1.0  # C of both mechanisms (per record for DP-SGD, per site update for DP-FedAvg)
TRAIN = TrainSettings(epochs=2, batch_size=32, lr=0.01, optimizer="adam")
METRICS = ("accuracy", "auroc")


def accountant_for(epsilon: float) -> Literal["rdp", "prv"]:
    """Opacus' RDP accountant for the curves; PRV below 0.2, which RDP's orders (up to 63) cannot certify at
    delta 1e-5 for any noise."""
    return "prv" if epsilon < 0.2 else "rdp"


def participant_noise(epsilon: float, rounds: int) -> float:
    """z that spends `epsilon` at DELTA over `rounds` rounds of the Gaussian mechanism with every site (q = 1)."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=DELTA, sample_rate=1.0, steps=rounds,
                                      accountant="rdp"))


def run_one(mechanism: str, epsilon: float | None, seed: int, rounds: int, out: Path) -> dict[str, Any]:
    train, algorithm, hyper = TRAIN, "fedavg", {}
    if epsilon is not None and mechanism == "record":
        train = TRAIN.model_copy(update={"dp": RecordDP(max_grad_norm=CLIP, target_epsilon=epsilon, delta=DELTA,
                                                        accountant=accountant_for(epsilon))})
    elif epsilon is not None:
        algorithm, hyper = "dp-fedavg", {"clip_norm": CLIP, "noise_multiplier": participant_noise(epsilon, rounds),
                                         "delta": DELTA}
    config = SimulationConfig(run_id="privacy", algorithm=algorithm, hyper=hyper, rounds=rounds, seed=seed,
                              out_dir=out, model=DEFAULT_MODEL, train=train)
    started = time.perf_counter()
    report = run_simulation(config, progress=False)
    per_site = report["final"]["per_site"]
    row: dict[str, Any] = {
        "mechanism": mechanism, "epsilon": epsilon, "seed": seed, "rounds": rounds, "wall_s": time.perf_counter()
        - started, "hyper": hyper,
        "test": {s: {m: per_site[s]["metrics"]["test"].get(m) for m in METRICS} for s in per_site},
        "mia_auc": membership_aucs(out / "final_model.safetensors"),
        "reported_epsilon": _reported_epsilon(report, mechanism),
    }
    return row


def membership_aucs(weights: Path, model: ModelSpec = DEFAULT_MODEL,
                    sites: dict[str, DataSpec] | None = None) -> dict[str, float]:
    """The loss-threshold attack on a final model at each site (default: the bundled heart-disease hospitals): its
    training rows against its held-out (validation and test) rows."""
    import torch
    from safetensors.numpy import load_file

    from fedmqtt.data.registry import load_site_data
    from fedmqtt.training.evaluate import predict_logits
    from fedmqtt.training.models import build_model
    from fedmqtt.training.weights import load_arrays

    torch.set_num_threads(1)
    net = build_model(model.name, dict(model.args))
    load_arrays(net, load_file(str(weights)))
    out = {}
    for site, spec in sorted((sites or bundled_sites()).items()):
        d = load_site_data(spec)
        held_x, held_y = np.concatenate([d.x_val, d.x_test]), np.concatenate([d.y_val, d.y_test])
        out[site] = membership_audit(binary_log_losses(predict_logits(net, d.x_train), d.y_train),
                                     binary_log_losses(predict_logits(net, held_x), held_y)).auc
    return out


def audit_grid(runs: Path, out: Path) -> None:
    """The attack on every finished run of a `fedmqtt grid` folder (its site data from each report), summarised
    per algorithm label: mean over seeds of the per-site mean AUC, bootstrap interval over sites."""
    by_label: dict[str, list[dict[str, float]]] = {}
    for point in sorted(runs.glob("*/grid_point.json")):
        if not (point.parent / "report.json").is_file():
            continue  # not finished
        labels = json.loads(point.read_text())
        report = json.loads((point.parent / "report.json").read_text())
        sites = {name: DataSpec.model_validate(spec) for name, spec in report["site_data"].items()}
        aucs = membership_aucs(point.parent / "final_model.safetensors", ModelSpec.model_validate(
            report["config"]["model"]), sites)
        by_label.setdefault(labels["algorithm"], []).append(aucs)
        print(f"{labels['run']}: MIA AUC {np.mean(list(aucs.values())):.3f}", flush=True)
    lines = ["| run | MIA AUC [95% CI] | seeds |", "|---|---|---|"]
    for label, per_seed in by_label.items():
        names = sorted(per_seed[0])
        matrix = np.array([[run[s] for run in per_seed] for s in names])
        mean, ci = site_seed_mean(matrix), mean_interval(matrix)
        shown = "n/a" if mean is None else f"{mean:.3f}" + ("" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]")
        lines.append(f"| {label} | {shown} | {len(per_seed)} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "mia.md").write_text("\n".join(lines) + "\n")
    (out / "mia.json").write_text(json.dumps(by_label, indent=1))
    print("\n".join(lines))


def _reported_epsilon(report: dict[str, Any], mechanism: str) -> float | None:
    """What the run's own accountant reported: the largest site epsilon, or the PS's after the last round."""
    if mechanism == "record":
        spent = (report.get("privacy") or {}).get("record_level") or {}
        return max((float(v["epsilon"]) for v in spent.values()), default=None)
    server = report["rounds"][-1].get("server") or {}
    return float(server["epsilon"]) if "epsilon" in server else None


def overfit_audit(epsilon: float | None, seed: int, members: int) -> float:
    """The attack on a single-site model trained on `members` rows (drawn by `seed`) for 50 epochs."""
    import torch

    from fedmqtt.data.registry import load_site_data
    from fedmqtt.training.evaluate import predict_logits
    from fedmqtt.training.loop import train_local
    from fedmqtt.training.models import build_model
    from fedmqtt.training.privacy import train_local_dp

    torch.set_num_threads(1)
    d = load_site_data(bundled_sites()["cleveland"])
    x = np.concatenate([d.x_train, d.x_val, d.x_test]).astype(np.float32)
    y = np.concatenate([d.y_train, d.y_val, d.y_test]).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(y))
    xm, ym, xo, yo = x[order[:members]], y[order[:members]], x[order[members:]], y[order[members:]]
    torch.manual_seed(seed)
    net = build_model("mlp", {"in_features": x.shape[1], "hidden": [64, 64], "norm": "none"})
    settings = TrainSettings(epochs=50, batch_size=8, lr=0.01, optimizer="adamw", weight_decay=0.05)
    if epsilon is None:
        train_local(net, xm, ym, settings, seed=seed)
    else:
        dp = RecordDP(max_grad_norm=CLIP, target_epsilon=epsilon, delta=DELTA, planned_rounds=1,
                      accountant=accountant_for(epsilon))
        train_local_dp(net, xm, ym, settings, dp, history=[])
    return membership_audit(binary_log_losses(predict_logits(net, xm), ym),
                            binary_log_losses(predict_logits(net, xo), yo)).auc


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mechanism, epsilon): mean over seeds of the per-site means, with the bootstrap interval."""
    table = []
    for key in sorted({(r["mechanism"], r["epsilon"]) for r in rows}, key=lambda k: (k[0], math.inf if k[1] is None
                                                                                      else k[1])):
        runs = [r for r in rows if (r["mechanism"], r["epsilon"]) == key]
        line: dict[str, Any] = {"mechanism": key[0], "epsilon": key[1], "seeds": sorted(r["seed"] for r in runs)}
        values = {f"test_{m}": [[r["test"][s][m] for r in runs] for s in SITES] for m in METRICS}
        values["mia_auc"] = [[r["mia_auc"][s] for r in runs] for s in SITES]
        for name, nested in values.items():
            matrix = np.array([[np.nan if v is None else v for v in per_seed] for per_seed in nested], dtype=float)
            line[name] = site_seed_mean(matrix)
            line[f"{name}_ci"] = mean_interval(matrix)
        reported = [r["reported_epsilon"] for r in runs if r["reported_epsilon"] is not None]
        line["reported_epsilon_max"] = max(reported) if reported else None
        table.append(line)
    return table


def markdown(table: list[dict[str, Any]]) -> str:
    def cell(line: dict[str, Any], name: str) -> str:
        ci = line[f"{name}_ci"]
        mean = line[name]
        return "n/a" if mean is None else f"{mean:.3f}" + ("" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]")

    out = ["| mechanism | epsilon | accountant's epsilon (max) | test accuracy [95% CI] | test AUROC [95% CI] | "
           "MIA AUC [95% CI] |", "|---|---|---|---|---|---|"]
    for line in table:
        eps = "none" if line["epsilon"] is None else f"{line['epsilon']:g}"
        rep = "-" if line["reported_epsilon_max"] is None else f"{line['reported_epsilon_max']:.3f}"
        out.append(f"| {line['mechanism']} | {eps} | {rep} | {cell(line, 'test_accuracy')} | "
                   f"{cell(line, 'test_auroc')} | {cell(line, 'mia_auc')} |")
    return "\n".join(out) + "\n"


def plot(table: list[dict[str, Any]], path: Path, audit: dict[str, list[float]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4 if audit else 3, figsize=(17 if audit else 13, 3.8))
    epsilons = sorted({line["epsilon"] for line in table if line["epsilon"] is not None})
    none_x = max(epsilons) * 2.5  # "no DP" drawn right of the largest epsilon
    for ax, name, title in zip(axes, ("test_accuracy", "test_auroc", "mia_auc"),
                               ("test accuracy", "test AUROC", "membership-inference AUC"), strict=False):
        for mechanism, style in (("record", "o-"), ("participant", "s--")):
            lines = sorted((line for line in table
                            if line["mechanism"] in (mechanism, "none") and line[name] is not None),
                           key=lambda line: none_x if line["epsilon"] is None else line["epsilon"])
            xs = [none_x if line["epsilon"] is None else line["epsilon"] for line in lines]
            ys = [line[name] for line in lines]
            lo = [line[name] - line[f"{name}_ci"][0] if line[f"{name}_ci"] else 0.0 for line in lines]
            hi = [line[f"{name}_ci"][1] - line[name] if line[f"{name}_ci"] else 0.0 for line in lines]
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, capsize=3, label=f"{mechanism}-level DP")
        if name == "mia_auc":
            ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xticks([*epsilons, none_x], [*(f"{e:g}" for e in epsilons), "none"])
        ax.minorticks_off()
        ax.set_xlabel("epsilon (delta = 1e-5)")
        ax.set_title(title)
    axes[0].legend()
    if audit:
        ax = axes[3]
        keys = sorted(audit, key=lambda k: none_x if k == "none" else float(k))
        xs = [none_x if k == "none" else float(k) for k in keys]
        for seed_index in range(len(audit[keys[0]])):
            ax.plot(xs, [audit[k][seed_index] for k in keys], ".", color="grey", alpha=0.6)
        ax.plot(xs, [float(np.mean(audit[k])) for k in keys], "o-", color="C2", label="mean over seeds")
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xticks([*epsilons, none_x], [*(f"{e:g}" for e in epsilons), "none"])
        ax.minorticks_off()
        ax.set_xlabel("epsilon (delta = 1e-5)")
        ax.set_title("MIA AUC, overfit single-site model")
        ax.legend()
    fig.suptitle("FedAvg on the bundled heart-disease federation (4 hospitals): mean over sites and seeds, "
                 "95% bootstrap CI over sites")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1, 2, 4, 8])
    parser.add_argument("--mechanisms", nargs="+", default=["record", "participant"],
                        choices=["record", "participant"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("docs/results/privacy"))
    parser.add_argument("--audit-members", type=int, default=20, help="rows of the overfit audit's model")
    parser.add_argument("--audit-runs", type=Path, help="only attack the final models of this `fedmqtt grid` "
                        "folder's runs (e.g. the stroke grid) and write mia.md and mia.json to --out")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from --out's results.json")
    parser.add_argument("--work", type=Path, default=Path("runs/privacy-utility"), help="each run's report, models")
    args = parser.parse_args()
    if args.audit_runs is not None:
        audit_grid(args.audit_runs, args.out)
        return
    if args.replot:
        saved = json.loads((args.out / "results.json").read_text())
        plot(saved["table"], args.out / "privacy_utility.png", saved["overfit_audit"]["auc_by_epsilon"])
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    plan = [("none", None)] + [(m, e) for m in args.mechanisms for e in args.epsilons]
    for mechanism, eps in plan:
        for seed in args.seeds:
            tag = f"{mechanism}-{'none' if eps is None else f'{eps:g}'}-seed{seed}"
            row = run_one(mechanism, eps, seed, args.rounds, args.work / tag)
            rows.append(row)
            print(f"{tag}: accuracy {np.nanmean([v['accuracy'] or np.nan for v in row['test'].values()]):.3f}, "
                  f"MIA AUC {np.mean(list(row['mia_auc'].values())):.3f}, epsilon reported "
                  f"{row['reported_epsilon']}, {row['wall_s']:.0f} s", flush=True)
            (args.out / "results.json").write_text(json.dumps({"runs": rows}, indent=1))
    table = summarise(rows)
    audit: dict[str, list[float]] = {}
    for eps in [None, *args.epsilons]:
        key = "none" if eps is None else f"{eps:g}"
        audit[key] = [overfit_audit(eps, seed, args.audit_members) for seed in args.seeds]
        print(f"overfit audit, epsilon {key}: MIA AUC {audit[key]}", flush=True)
    (args.out / "results.json").write_text(json.dumps({"runs": rows, "table": table, "overfit_audit": {
        "members": args.audit_members, "auc_by_epsilon": audit}}, indent=1))
    text = markdown(table) + "\n" + audit_markdown(audit, args.audit_members)
    (args.out / "table.md").write_text(text)
    plot(table, args.out / "privacy_utility.png", audit)
    print(text)


def audit_markdown(audit: dict[str, list[float]], members: int) -> str:
    out = [f"Overfit audit (Cleveland, {members} training rows, 50 epochs; one AUC per seed):", "",
           "| epsilon | MIA AUC mean | per seed |", "|---|---|---|"]
    for key, values in audit.items():
        out.append(f"| {key} | {np.mean(values):.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
