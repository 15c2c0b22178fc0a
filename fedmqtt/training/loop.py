"""One site's local training pass: seeded, deterministic, with an optional FedProx proximal term."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedmqtt.training.client_rules import GradTerms
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
    terms: GradTerms | None = None,
) -> TrainStats:
    """Train `model` in place for `settings.epochs` passes over `(x, y)` with binary cross-entropy.

    Shuffling uses a `torch.Generator` seeded with `seed`; dropout uses the global RNG, reseeded
    inside a fork so the caller's RNG state is untouched. The optimizer is new on every call
    (algorithms.md 0.5). `terms` adds the algorithm's client-side gradient terms (FedProx/FedPxN
    proximal, FedDyn, SCAFFOLD correction), anchored on the weights this call started from.
    """
    started = time.perf_counter()
    dev = torch.device(device)
    model.to(dev).train()
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32), device=dev)
    yt = torch.as_tensor(np.asarray(y, dtype=np.float32), device=dev).reshape(-1)
    if xt.ndim != 2 or xt.shape[0] != yt.shape[0]:
        raise ValueError(f"features {tuple(xt.shape)} and labels {tuple(yt.shape)} do not match")
    terms = terms or GradTerms()
    if terms.freeze_norm:
        _freeze_batchnorm(model)
    params = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    optimizer = _make_optimizer(params, settings)
    correct = _gradient_terms(model, terms, dev)
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
                loss.backward()
                if correct is not None:
                    correct()
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


def _gradient_terms(model: nn.Module, terms: GradTerms, dev: torch.device) -> Callable[[], None] | None:
    """A function adding the algorithm's terms to the gradients, or None when there are none.

    Written into the gradient explicitly, so `mu`, `alpha` and the SCAFFOLD shift mean exactly what
    algorithms.md says whatever the optimizer (never delegated to weight decay).
    """
    named = dict(model.named_parameters())
    prox = [n for n in terms.prox_names if n in named] if terms.prox_mu > 0 else []
    dyn = {n: torch.as_tensor(v, device=dev) for n, v in terms.dyn_s.items() if n in named}
    shift = {n: torch.as_tensor(v, device=dev) for n, v in terms.shift.items() if n in named}
    if not (prox or dyn or shift):
        return None
    anchor = {n: named[n].detach().clone() for n in {*prox, *dyn}}

    def apply() -> None:
        with torch.no_grad():
            for n in prox:
                named[n].grad.add_(named[n] - anchor[n], alpha=terms.prox_mu)
            for n, s in dyn.items():
                named[n].grad.add_(s + named[n] - anchor[n], alpha=terms.dyn_alpha)
            for n, c in shift.items():
                named[n].grad.add_(c)

    return apply


def _freeze_batchnorm(model: nn.Module) -> None:
    """FedFBN: BatchNorm runs on its pretrained statistics and is never trained (algorithms.md 14)."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()
            for p in module.parameters():
                p.requires_grad_(False)


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
