"""The Central (pooled) baseline for reports: one model trained on every site's training rows at once.

Only a simulation can do this (the data never leaves a hospital in a deployment). Each site is
still evaluated on its own validation and test splits, and the report has the same layout as a
federated run's report.json, so `fedmqtt report` compares them side by side.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from fedmqtt.means import direction_of, mean_defined

if TYPE_CHECKING:
    from fedmqtt.simulation_config import SimulationConfig


def run_central(config: SimulationConfig, *, progress: bool = True) -> dict[str, Any]:
    """Train on the pooled training splits for `rounds` x `epochs` epochs; evaluate every site each round."""
    import torch
    from tqdm import tqdm

    from fedmqtt.training.evaluate import evaluate_split
    from fedmqtt.training.loop import derive_seed, train_local
    from fedmqtt.training.models import build_model
    from fedmqtt.training.targets import init_output_bias
    from fedmqtt.training.weights import initial_arrays, load_arrays, state_to_arrays
    from site_agent.data import load_site_data

    torch.set_num_threads(1)
    started = time.time()
    data = {site: load_site_data(spec) for site, spec in sorted(config.sites.items())}
    task = next(iter(data.values())).task
    x = np.concatenate([d.x_train for d in data.values()])
    y = np.concatenate([d.y_train for d in data.values()])
    args = dict(config.model.args)
    model = build_model(config.model.name, args)
    load_arrays(model, initial_arrays(config.model.name, args, config.seed))
    nonneg = task.kind == "regression"
    rounds, best, best_weights = [], None, None
    sign = 1.0 if direction_of(config.selection_metric) == "max" else -1.0
    for r in tqdm(range(1, config.rounds + 1), desc="central (pooled)", unit="round", disable=not progress):
        t0 = time.time()
        per_site = {s: evaluate_split(model, d.x_val, d.y_val, task=task, nonnegative=nonneg)[0]
                    for s, d in data.items()}
        names = sorted({k for m in per_site.values() for k in m})
        mean = {k: mean_defined(m.get(k) for m in per_site.values()) for k in names}
        score = mean.get(config.selection_metric)
        if score is not None and (best is None or sign * score > sign * best[1]):
            best, best_weights = (r, score), state_to_arrays(model)
        if r == 1:  # a regression head starts at the pooled mean target (training.targets), as at every site
            init_output_bias(model, y, task)
        stats = train_local(model, x, y, config.train, seed=derive_seed(config.seed, "central", r), task=task)
        rounds.append({"round": r, "sites": sorted(data), "stragglers": [], "per_site": per_site, "mean": mean,
                       "train_loss": stats.mean_loss, "n_samples": {"pooled": int(len(y))},
                       "started_at": t0, "closed_at": time.time(), "duration_s": time.time() - t0})
    def per_site_eval() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for site, d in data.items():
            metrics, undefined = {}, {}
            for split in ("val", "test"):
                metrics[split], why = evaluate_split(model, getattr(d, f"x_{split}"), getattr(d, f"y_{split}"),
                                                     task=task, nonnegative=nonneg)
                undefined.update({f"{split}.{k}": v for k, v in why.items()})
            out[site] = {"metrics": metrics, "n_samples": {"val": d.n_val, "test": d.n_test}, "undefined": undefined}
        return out

    def means(entries: dict[str, Any]) -> dict[str, Any]:
        return {split: {k: mean_defined(e["metrics"][split].get(k) for e in entries.values())
                        for k in sorted({k for e in entries.values() for k in e["metrics"][split]})}
                for split in ("val", "test")}

    final = per_site_eval()
    mean_final = means(final)
    final_weights = state_to_arrays(model)  # the held-out union (fedmqtt report --held-out) scores it
    best_section = None
    # Hwang et al.'s protocol: the best validation round's model on test
    if best is not None and best_weights is not None:
        load_arrays(model, best_weights)
        best_sites = per_site_eval()
        best_section = {"round": best[0], "per_site": best_sites, "mean": means(best_sites)}
    report = {
        "run_id": config.run_id, "algorithm": "central", "config": config.model_dump(mode="json"),
        "rounds": rounds, "final": {"model_hash": None, "per_site": final, "mean": mean_final},
        "best_round": None if best is None else {"round": best[0], "score": best[1],
                                                 "metric": f"val {config.selection_metric}"},
        "best": best_section,
        "recruitment": None, "timings": {"started_at": started, "finished_at": time.time(),
                                         "total_s": time.time() - started},
        "traffic": {}, "models": {},
    }
    config.out_dir.mkdir(parents=True, exist_ok=True)
    (config.out_dir / "report.json").write_text(json.dumps(report, indent=2))
    from safetensors.numpy import save_file

    save_file(final_weights, str(config.out_dir / "final_model.safetensors"))
    if best_weights is not None:
        save_file(best_weights, str(config.out_dir / "best_model.safetensors"))
    return report
