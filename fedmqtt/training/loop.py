"""One site's local training pass: seeded, deterministic, with an optional FedProx proximal term."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from schemas.messages import TrainSettings


@dataclass(frozen=True)
class TrainStats:
    """What a local training call did: samples seen per epoch, optimizer steps, mean batch loss, time."""

    n_samples: int
    steps: int
    mean_loss: float | None  # None when no step was taken (e.g. a single training row)
    seconds: float


def derive_seed(run_seed: int, site_id: str, round_no: int) -> int:
    """A 63-bit seed for (run, site, round), identical in every process and on every platform."""
    # hashlib, not hash(): str hashing is salted per process (PYTHONHASHSEED).
    digest = hashlib.sha256(f"{run_seed}\x1f{site_id}\x1f{round_no}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def train_local(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    settings: TrainSettings,
    *,
    seed: int,
    device: str | torch.device = "cpu",
) -> TrainStats:
    """Train `model` in place for `settings.epochs` passes over `(x, y)` with binary cross-entropy.

    Shuffling uses a `torch.Generator` seeded with `seed`; dropout uses the global RNG, reseeded
    inside a fork so the caller's RNG state is untouched. The optimizer is new on every call
    (algorithms.md 0.5). `settings.hyper["mu"] > 0` adds FedProx's `mu/2 * ||w - w_start||^2` over
    trainable parameters, where `w_start` are the weights this call started from.
    """
    started = time.perf_counter()
    dev = torch.device(device)
    model.to(dev).train()
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32), device=dev)
    yt = torch.as_tensor(np.asarray(y, dtype=np.float32), device=dev).reshape(-1)
    if xt.ndim != 2 or xt.shape[0] != yt.shape[0]:
        raise ValueError(f"features {tuple(xt.shape)} and labels {tuple(yt.shape)} do not match")
    params = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    optimizer = _make_optimizer(params, settings)
    mu = float(settings.hyper.get("mu", 0.0))
    anchor = [p.detach().clone() for p in params] if mu > 0 else []
    loss_fn = nn.BCEWithLogitsLoss()
    shuffle = torch.Generator().manual_seed(seed)
    steps, loss_sum, loss_rows = 0, 0.0, 0
    with _seeded_global_rng(seed, dev):
        for _ in range(settings.epochs):
            for idx in _batches(xt.shape[0], settings.batch_size, shuffle):
                idx = idx.to(dev)
                optimizer.zero_grad(set_to_none=True)
                logits = model(xt[idx]).reshape(-1)
                loss = loss_fn(logits, yt[idx])
                total = loss + _proximal(params, anchor, mu) if mu > 0 else loss
                total.backward()
                optimizer.step()
                steps += 1
                loss_sum += float(loss.detach()) * len(idx)
                loss_rows += len(idx)
    # NaN here (a diverged run) is reported as is; the caller decides what to do with it.
    mean_loss = loss_sum / loss_rows if loss_rows else None
    return TrainStats(int(xt.shape[0]), steps, mean_loss, time.perf_counter() - started)


def _batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    order = torch.randperm(n, generator=generator)
    for start in range(0, n, batch_size):
        idx = order[start : start + batch_size]
        # BatchNorm cannot train on one sample: drop a trailing batch of 1 (algorithms.md 0.5).
        if len(idx) == 1 and batch_size > 1:
            continue
        yield idx


def _make_optimizer(params: list[nn.Parameter], settings: TrainSettings) -> torch.optim.Optimizer:
    if settings.optimizer == "sgd":
        momentum = float(settings.hyper.get("momentum", 0.0))
        return torch.optim.SGD(params, lr=settings.lr, momentum=momentum, weight_decay=settings.weight_decay)
    if settings.optimizer == "adam":
        return torch.optim.Adam(params, lr=settings.lr, weight_decay=settings.weight_decay)
    return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)


def _proximal(params: list[nn.Parameter], anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx term (mu/2) * sum ||w - w_global||^2 over trainable parameters (never buffers)."""
    sq = sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
    return 0.5 * mu * sq  # type: ignore[return-value]


@contextmanager
def _seeded_global_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seed the global RNG (dropout draws from it) inside a fork, restoring the caller's state after."""
    cuda: list[int] = []
    if device.type == "cuda":
        cuda = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)  # only the device fork_rng saved and will restore
        yield
