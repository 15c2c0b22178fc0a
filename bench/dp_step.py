"""DP-SGD against plain local training, side by side: the time of one training step on the zoo's MLP and LeNet.

    nice .venv/bin/python bench/dp_step.py --repeats 5 --threads 1

For each model, one local round (same rows, batch size, epochs and SGD settings) runs in turn through the
plain loop (`fedmqtt.training.loop.train_local`) and through DP-SGD (`fedmqtt.training.privacy.train_local_dp`:
per-record gradients, clipping, noise, Poisson sampling, and the accountant's epsilon after the round) with each
engine: the fused engine's one-pass per-layer clipping (fedmqtt/training/fused_clipping.py), Opacus' ghost
clipping and torch.func's vmapped per-record gradients (fedmqtt/training/per_sample.py).
Each round's wall time is divided by its steps; the table gives the median over the repeats and the ratios
DP / plain of those medians (the issue's goal: at most 2x); a second table gives, per engine, the ratio of each
repeat's DP round to the plain round just before it (median, lowest, highest), which load drifting over a run
moves less, and the same for the fused engine with noise multiplier 0 (not private: it shows what the Gaussian
draw for every parameter costs); a third table the same ratios of this process's CPU time (one torch thread: the
work itself, without the time spent waiting for a core that other processes hold). The DP time includes
everything a DP round costs a site beyond its steps (wrapping the model, the accountant before and after), spread
over the round's steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmqtt.data.base import BINARY, TaskInfo  # noqa: E402
from fedmqtt.training.loop import train_local  # noqa: E402
from fedmqtt.training.models import build_model  # noqa: E402
from fedmqtt.training.privacy import choose_engine, train_local_dp  # noqa: E402
from schemas.messages import RecordDP, TrainSettings  # noqa: E402

# (label, registry name, args, input shape of one row, task)
MODELS = [
    ("MLP 15-32-32-1 (heart disease)", "mlp", {"in_features": 15, "hidden": [32, 32]}, (15,), BINARY),
    ("MLP 784-256-256-10", "mlp", {"in_features": 784, "hidden": [256, 256], "out_features": 10}, (784,),
     TaskInfo("multiclass", 10)),
    ("LeNet-5 28x28, GroupNorm", "lenet5", {"n_classes": 10, "norm": "gn"}, (1, 28, 28), TaskInfo("multiclass", 10)),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048, help="training rows (default 2048)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--epochs", type=int, default=1, help="local epochs per round (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of each kind per model (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    return p.parse_args(argv)


def data(shape: tuple[int, ...], task: TaskInfo, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, *shape)).astype(np.float32)
    y = rng.integers(0, 2 if task.kind == "binary" else task.n_outputs, size=rows)
    return x, y


ENGINES = ("fused", "opacus", "torch.func")  # record_dp.engine; "auto" picks one of these (privacy.choose_engine)
NOISELESS = "fused, sigma 0"  # the fused engine with noise multiplier 0: what the noise draw costs (not private)


def one_round(engine: str | None, model: torch.nn.Module, x: np.ndarray, y: np.ndarray, settings: TrainSettings,
              dp: RecordDP, task: TaskInfo) -> tuple[float, float]:
    """Seconds per step of one local round, wall-clock and this process's CPU time: plain (engine None) or DP-SGD
    through `engine`."""
    start, cpu = time.perf_counter(), time.process_time()
    if engine == NOISELESS:
        dp = dp.model_copy(update={"engine": "fused", "noise_multiplier": 0.0})
        steps = train_local_dp(model, x, y, settings, dp, history=[], task=task, seed=0).stats.steps
    elif engine is not None:
        dp = dp.model_copy(update={"engine": engine})
        steps = train_local_dp(model, x, y, settings, dp, history=[], task=task, seed=0).stats.steps
    else:
        steps = train_local(model, x, y, settings, seed=0, task=task).steps
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    settings = TrainSettings(epochs=a.epochs, batch_size=a.batch_size, lr=0.05, optimizer="sgd")
    dp = RecordDP(max_grad_norm=1.0, noise_multiplier=1.0)
    print(f"{a.rows} rows, batch {a.batch_size}, {a.epochs} epoch(s), SGD, {a.threads} thread(s), torch "
          f"{torch.__version__}, median of {a.repeats} rounds each (interleaved: plain, {', '.join(ENGINES)}, "
          f"{NOISELESS}, ...)")
    print(f"load average before: {_load()}\n")
    print("| model | parameters | plain ms/step | fused ms/step | Opacus ghost ms/step | torch.func ms/step "
          "| fused / plain | Opacus / plain | torch.func / plain | auto picks |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    kinds: tuple[str | None, ...] = (None, *ENGINES, NOISELESS)
    paired: list[str] = []
    paired_cpu: list[str] = []
    for label, name, args, shape, task in MODELS:
        x, y = data(shape, task, a.rows)
        torch.manual_seed(0)
        model = build_model(name, args)
        n_params = sum(p.numel() for p in model.parameters())
        times: dict[str | None, list[float]] = {k: [] for k in kinds}
        cpu: dict[str | None, list[float]] = {k: [] for k in kinds}
        for kind in kinds:  # warm-up: the first calls import and allocate
            one_round(kind, model, x, y, settings, dp, task)
        for _ in range(a.repeats):
            for kind in kinds:
                wall, used = one_round(kind, model, x, y, settings, dp, task)
                times[kind].append(wall)
                cpu[kind].append(used)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        auto = choose_engine("auto", model, a.batch_size)
        cells = " | ".join(f"{ms[k]:.2f}" for k in ENGINES)
        ratios = " | ".join(f"{ms[k] / ms[None]:.2f}x" for k in ENGINES)
        print(f"| {label} | {n_params:,} | {ms[None]:.2f} | {cells} | {ratios} | {auto} |", flush=True)
        paired.append(_paired_row(label, times))
        paired_cpu.append(_paired_row(label, cpu))
    for title, rows in (("wall-clock", paired), ("CPU time of this process (what other processes' load moves least)",
                                                 paired_cpu)):
        print(f"\nPer repeat, DP round / the plain round before it, {title}: median (lowest-highest)\n")
        print("| model | " + " | ".join(f"{k} / plain" for k in (*ENGINES, NOISELESS)) + " |")
        print("|---|" + "---|" * (len(ENGINES) + 1))
        print("\n".join(rows))
    print(f"\nload average after: {_load()}")


def _paired_row(label: str, seconds: dict[str | None, list[float]]) -> str:
    return f"| {label} | " + " | ".join(_spread([d / p for d, p in zip(seconds[k], seconds[None], strict=True)])
                                        for k in (*ENGINES, NOISELESS)) + " |"


def _spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


if __name__ == "__main__":
    main()
