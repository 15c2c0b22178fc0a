"""A site's local training round on a GPU: the product's path beside a bare torch loop doing the same work.

    python3 bench/gpu_round.py --out gpu_round.json                   # a CUDA machine; stops starting work at 300 s
    python3 bench/gpu_round.py --device cpu --images 64 --size 32 --ecg-records 64 --ecg-samples 500 --rounds 1

What runs is what a site agent runs each round: `site_agent.trainer.Trainer.train` (validation, then
`train_local` inside a `UsageMeter`, then the weights back as numpy), with the site's default settings but
batch 64, on synthetic data (normal noise, random binary labels: throughput, not accuracy):
- a ResNet-sized vision model of the zoo (DenseNet-121 by default) on `--images` 3 x size x size images;
- the zoo's 1-D ResNet for 12-lead ECG (resnet1d_se) on `--ecg-records` records of 12 x `--ecg-samples`.
Each model runs in full precision, in bfloat16 autocast (the site's `amp = "bf16"`, what `auto` picks on a
recent NVIDIA GPU), and in bfloat16 with the training split forced into pinned host memory: the loop keeps
the split on the GPU when it takes under `_GPU_RESIDENT_FRACTION` of free GPU memory, so this bench sets that
module constant to 0 for the configuration (no product code changes). Each configuration: 1 warm-up round,
then `--rounds` measured rounds, the product's and the bare loop's alternating.

Per configuration one line and one JSON row (written to `--out` after every configuration, default
$OUT/gpu_round.json when OUT is set): training wall s per round (UsageMeter's) and samples/s, mean GPU
utilisation (UsageMeter's NVML samples), NVML energy J per round and per 1,000 samples, peak GPU memory,
the whole site round (validation and weight copies included), and the ratio of the product's training
time to the bare loop's (same model, data, device, autocast, epochs; one upload of the split per round as
the product does; no per-step sync; in the pinned configuration batches are gathered on the host and pinned
as the product does, without pinning the whole split first), with its own utilisation and energy from a
UsageMeter.
`--budget-s` stops starting configurations whose estimated time would pass it, and lists what it skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from fedmqtt.data.splits import SiteData  # noqa: E402
from fedmqtt.training import loop  # noqa: E402
from fedmqtt.training.models import build_model  # noqa: E402
from fedmqtt.training.usage import UsageMeter  # noqa: E402
from fedmqtt.training.weights import initial_arrays, load_arrays  # noqa: E402
from schemas.messages import ModelSpec, ResourceUsage, TrainSettings  # noqa: E402
from site_agent.trainer import Trainer, pick_device, use_threads  # noqa: E402


@dataclass(frozen=True)
class Config:
    family: str  # "vision" or "ecg"
    amp: str  # the site's `amp` setting: "off" or "bf16"
    pinned: bool

    @property
    def name(self) -> str:
        return f"{self.family} {'bf16' if self.amp == 'bf16' else 'fp32'} {'pinned' if self.pinned else 'resident'}"


# Interleaved, so a budget that runs out still leaves both models measured in the site's default precision.
CONFIGS = [Config(f, a, p) for a, p in (("bf16", False), ("off", False), ("bf16", True)) for f in ("vision", "ecg")]


def synthetic_site(shape: tuple[int, ...], n: int, seed: int) -> SiteData:
    """Noise with random binary labels; a validation split of n/16 rows, as a site validates every round."""
    rng = np.random.default_rng(seed)
    n_val = max(n // 16, 2)
    x = rng.standard_normal((n + n_val, *shape), dtype=np.float32)
    y = rng.integers(0, 2, n + n_val)
    empty = np.zeros((0, *shape), np.float32)
    return SiteData(x[:n], y[:n], x[n:], y[n:], empty, y[:0], feature_names=())


def bare_round(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, *, batch: int, epochs: int, lr: float,
               device: str, amp: str | None, resident: bool, seed: int) -> None:
    """The same epochs in plain torch: no per-step sync, loss kept on the device, torch.optim.Adam."""
    dev = torch.device(device)
    model.to(dev).train()
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    xt = torch.as_tensor(x, device=dev) if resident else torch.from_numpy(x)
    yt = torch.as_tensor(y.astype(np.float32), device=dev) if resident else torch.from_numpy(y.astype(np.float32))
    shuffle = torch.Generator().manual_seed(seed)
    total = torch.zeros((), device=dev)
    for _ in range(epochs):
        order = torch.randperm(len(xt), generator=shuffle)
        order = order.to(dev) if resident else order
        for start in range(0, len(xt), batch):
            idx = order[start:start + batch]
            if resident:
                xb, yb = xt[idx], yt[idx]
            else:
                xb = xt[idx].pin_memory().to(dev, non_blocking=True)
                yb = yt[idx].pin_memory().to(dev, non_blocking=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp is not None):
                loss = F.binary_cross_entropy_with_logits(model(xb).float().reshape(-1), yb)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            total += loss.detach()
    float(total)  # one sync at the end (UsageMeter synchronises too)


@contextmanager
def split_in_pinned_memory(on: bool) -> Iterator[None]:
    """The loop's GPU-resident threshold at 0 while `on`: every split goes to pinned host memory."""
    saved = loop._GPU_RESIDENT_FRACTION
    if on:
        loop._GPU_RESIDENT_FRACTION = 0.0
    try:
        yield
    finally:
        loop._GPU_RESIDENT_FRACTION = saved


def mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def run_config(cfg: Config, spec: ModelSpec, data: SiteData, args: argparse.Namespace) -> dict[str, Any]:
    trainer = Trainer("site-000", data, device=args.device, amp=cfg.amp)  # as site_agent.agent builds it
    settings = TrainSettings(epochs=args.epochs, batch_size=args.batch)  # the PS's defaults but the batch
    weights = initial_arrays(spec.name, dict(spec.args), 0)
    bare_model = build_model(spec.name, dict(spec.args))
    load_arrays(bare_model, weights)
    product: list[tuple[ResourceUsage, float]] = []
    bare: list[ResourceUsage] = []
    with split_in_pinned_memory(cfg.pinned):
        for round_no in range(1, args.rounds + 2):  # round 1 is the warm-up
            started = time.perf_counter()
            result = trainer.train(spec, weights, settings, round_no)
            site_round_s = time.perf_counter() - started
            weights = result.weights  # a one-site federation: the global model is the site's own
            with UsageMeter(args.device, trainer.amp) as meter:
                bare_round(bare_model, data.x_train, data.y_train, batch=args.batch, epochs=args.epochs,
                           lr=settings.lr, device=args.device, amp=trainer.amp, resident=not cfg.pinned,
                           seed=round_no)
            if round_no > 1:
                assert result.usage is not None and meter.usage is not None
                product.append((result.usage, site_round_s))
                bare.append(meter.usage)
    samples = result.n_samples * args.epochs
    train_s, bare_s = mean([u.wall_s for u, _ in product]), mean([u.wall_s for u in bare])
    energy = mean([u.energy_j for u, _ in product])
    assert train_s is not None and bare_s is not None
    peaks = [u.gpu_peak_mem_mb for u, _ in product if u.gpu_peak_mem_mb is not None]
    return {
        "config": cfg.name, "model": spec.name, "model_args": dict(spec.args), "amp": trainer.amp,
        "data": "pinned" if cfg.pinned else "resident", "samples_per_round": samples, "rounds": len(product),
        "train_s": train_s, "samples_per_s": samples / train_s, "cpu_s": mean([u.cpu_s for u, _ in product]),
        "gpu_util_pct": mean([u.gpu_util_pct for u, _ in product]), "energy_j": energy,
        "j_per_1k_samples": energy * 1000 / samples if energy is not None else None,
        "peak_mem_mb": max(peaks) if peaks else None, "site_round_s": mean([s for _, s in product]),
        "bare_s": bare_s, "bare_gpu_util_pct": mean([u.gpu_util_pct for u in bare]),
        "bare_energy_j": mean([u.energy_j for u in bare]), "ratio_to_bare": train_s / bare_s,
    }


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def line(row: dict[str, Any]) -> str:
    return (f"{row['config']:<22} {row['train_s']:7.3f} s/round {row['samples_per_s']:8.0f} samples/s | "
            f"GPU {fmt(row['gpu_util_pct'], '.1f')} % | {fmt(row['energy_j'], '.0f')} J/round "
            f"{fmt(row['j_per_1k_samples'], '.1f')} J/1k | peak {fmt(row['peak_mem_mb'], '.0f')} MB | "
            f"site round {row['site_round_s']:.3f} s | bare {row['bare_s']:.3f} s "
            f"(GPU {fmt(row['bare_gpu_util_pct'], '.1f')} %, {fmt(row['bare_energy_j'], '.0f')} J) "
            f"ratio {row['ratio_to_bare']:.2f}")


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "device": device,
                           "torch_threads": torch.get_num_threads(), "cudnn_benchmark": torch.backends.cudnn.benchmark}
    try:
        import torchvision

        env["torchvision"] = torchvision.__version__
    except ImportError:
        env["torchvision"] = None
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        env["bf16_supported"] = torch.cuda.is_bf16_supported()
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,power.limit", "--format=csv"],
                             capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = (smi.stdout or smi.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        env["nvidia_smi"] = f"unavailable: {exc}"
    return env


def save(report: dict[str, Any], out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(report, indent=1))


def parse_args() -> argparse.Namespace:
    out = os.environ.get("OUT")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cuda, cuda:N or cpu")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per configuration (after 1 warm-up)")
    p.add_argument("--images", type=int, default=4096, help="training images per round (vision)")
    p.add_argument("--size", type=int, default=224, help="image side in pixels")
    p.add_argument("--vision", default="densenet121", choices=["densenet121", "efficientnet_b0"])
    p.add_argument("--ecg-records", type=int, default=8192, help="training ECG records per round")
    p.add_argument("--ecg-samples", type=int, default=5000, help="samples per lead (500 Hz x 10 s)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (a site's default: 1)")
    p.add_argument("--only", default="", help="comma-separated families to run (vision, ecg); default both")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no configuration whose estimated time would end past this many seconds")
    p.add_argument("--out", default=str(Path(out) / "gpu_round.json") if out else None, help="JSON results file")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    began = time.perf_counter()
    args.device = pick_device(args.device)
    use_threads(args.threads)  # as a site agent does on its training thread
    env = environment(args.device)
    print(env["nvidia_smi"])
    print(" ".join(f"{k}={v}" for k, v in env.items() if k != "nvidia_smi"), flush=True)
    families = {"vision": (ModelSpec(name=args.vision, args={"n_outputs": 1}), (3, args.size, args.size),
                           args.images),
                "ecg": (ModelSpec(name="resnet1d_se", args={"in_leads": 12, "n_outputs": 1}),
                        (12, args.ecg_samples), args.ecg_records)}
    wanted = set(args.only.split(",")) if args.only else set(families)
    report: dict[str, Any] = {"environment": env, "args": vars(args), "results": [], "skipped": []}
    data: dict[str, SiteData] = {}
    cost: dict[str, float] = {}  # the last configuration's seconds per family: the next one's estimate
    for cfg in (c for c in CONFIGS if c.family in wanted):
        elapsed = time.perf_counter() - began
        why = None
        if cfg.pinned and not args.device.startswith("cuda"):
            why = "the pinned-memory path needs CUDA"
        elif cfg.amp == "bf16" and not args.device.startswith("cuda"):
            why = "no autocast on the CPU (usage.pick_amp): the same as fp32 there"
        elif elapsed + cost.get(cfg.family, 0.0) > args.budget_s:
            why = f"budget: {elapsed:.0f} of {args.budget_s:.0f} s spent" + (
                f", the last {cfg.family} configuration took {cost[cfg.family]:.0f} s" if cfg.family in cost else "")
        if why:
            print(f"{cfg.name:<22} skipped ({why})", flush=True)
            report["skipped"].append({"config": cfg.name, "why": why})
            continue
        spec, shape, n = families[cfg.family]
        started = time.perf_counter()
        try:
            if cfg.family not in data:
                data[cfg.family] = synthetic_site(shape, n, seed=0)
            row = run_config(cfg, spec, data[cfg.family], args)
            print(line(row), flush=True)
            report["results"].append(row)
        except Exception as exc:  # noqa: BLE001 - one failed configuration (OOM, no torchvision) must not end the run
            print(f"{cfg.name:<22} failed: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
            report["skipped"].append({"config": cfg.name, "why": f"{type(exc).__name__}: {exc}"})
        cost[cfg.family] = time.perf_counter() - started
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        save(report, args.out)  # after every configuration: a run cut short keeps what it measured
    save(report, args.out)
    print(f"done in {time.perf_counter() - began:.0f} s; {len(report['results'])} configurations measured, "
          f"{len(report['skipped'])} skipped" + (f"; results in {args.out}" if args.out else ""), flush=True)


if __name__ == "__main__":
    main()
