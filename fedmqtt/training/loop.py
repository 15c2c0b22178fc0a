"""One site's local training pass: seeded, deterministic, any task and input rank, algorithm terms added."""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedmqtt.data.base import BINARY, TaskInfo
from fedmqtt.errors import ConfigError
from fedmqtt.strategies.params import check_local_optimiser
from fedmqtt.training.client_rules import GradTerms
from fedmqtt.training.optimisers import LocalOptimiser
from fedmqtt.training.targets import is_log_target, to_model_scale
from schemas.messages import TrainSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainStats:
    """What a local training call did: samples seen per epoch, optimizer steps, mean batch loss, time."""

    n_samples: int
    steps: int
    mean_loss: float | None  # None when no step was taken (e.g. a single training row)
    seconds: float
    no_step_reason: str = ""  # why no step was taken, when none was (the site says so instead of an update)


def derive_seed(run_seed: int, site_id: str, round_no: int) -> int:
    """A 63-bit seed for (run, site, round), identical in every process and on every platform."""
    # hashlib, not hash(): str hashing is salted per process (PYTHONHASHSEED).
    digest = hashlib.sha256(f"{run_seed}\x1f{site_id}\x1f{round_no}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


# The losses each task accepts; the first is what "auto" picks.
TASK_LOSSES: dict[str, tuple[str, ...]] = {
    "binary": ("bce",),
    "multiclass": ("ce",),
    "multilabel": ("bce",),
    "regression": ("mse", "msle"),
}
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_loss(loss: str, task: TaskInfo) -> str:
    """The loss to train `task` with: `loss`, or the task's default for "auto".

    Raises:
        ConfigError: `loss` does not fit the task's kind.
    """
    allowed = TASK_LOSSES[task.kind]
    if loss == "auto":
        return allowed[0]
    if loss not in allowed:
        raise ConfigError(f"loss {loss!r} does not fit a {task.kind} task (use {list(allowed)} or auto)")
    return loss


def make_loss(name: str) -> LossFn:
    """`(model output, labels) -> scalar loss` for a resolved loss name."""
    return {"bce": _bce, "ce": _cross_entropy, "mse": _mse, "msle": _msle}[name]


def _bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if y.ndim == 1:  # binary: one logit per row
        return F.binary_cross_entropy_with_logits(logits.reshape(-1), y)
    # Multi-label with partial labels: NaN = not annotated, left out of the mean (Kulkarni et al.). The target
    # is zeroed there too, so no NaN reaches the graph even through a zero weight.
    annotated = ~torch.isnan(y)
    per_entry = F.binary_cross_entropy_with_logits(
        logits.reshape(y.shape), torch.where(annotated, y, torch.zeros_like(y)), reduction="none"
    )
    mask = annotated.to(per_entry.dtype)
    return (per_entry * mask).sum() / mask.sum().clamp(min=1.0)


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y)


def _mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred.reshape(y.shape), y)


def _msle(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Scheltjens et al.: the prediction is clamped at 0 before the log (their model ends in a ReLU), so the loss VALUE
    # (and what evaluation reads, evaluate.predict(nonnegative=True)) is that of max(pred, 0). Its gradient
    # passes through the clamp (straight-through): with the clamp's own zero gradient a fresh network whose
    # outputs start negative never learns. Where pred >= 0 nothing changes.
    pred = pred.reshape(y.shape)
    clamped = pred.clamp(min=0.0)
    through = clamped + torch.where(pred < 0, pred - pred.detach(), torch.zeros_like(pred))
    return F.mse_loss(torch.log1p(through), torch.log1p(y))


def balanced_loss(name: str, y: torch.Tensor, task: TaskInfo) -> LossFn:
    """`make_loss(name)` with class weights from this site's training labels `y` (train.hyper
    balance_classes = 1): every class (binary, multiclass) or every label's positives (multilabel) weighs
    as much in total as the rest, n_neg / n_pos for BCE's positives, n / (C n_c) for cross-entropy.

    Raises:
        ValueError: a regression task (there are no classes to balance).
    """
    if task.kind == "regression":
        raise ValueError("balance_classes needs classes; this is a regression task")
    if name == "ce":
        counts = torch.bincount(y.reshape(-1), minlength=task.n_outputs).double()
        weight = torch.where(counts > 0, counts.sum() / (len(counts) * counts.clamp(min=1)), 0.0).float()
        return lambda logits, yb: F.cross_entropy(logits, yb, weight=weight.to(logits.device))
    annotated = ~torch.isnan(y)
    pos = torch.where(annotated, y, torch.zeros_like(y)).sum(dim=0).double()
    neg = annotated.sum(dim=0).double() - pos
    # One class only (no positive, or no negative): nothing to balance, weight 1. n_neg / n_pos would be 0 for a
    # site that holds only positives, and its loss would vanish: it would never train.
    pos_weight = torch.where((pos > 0) & (neg > 0), neg / pos.clamp(min=1), 1.0).float()
    if y.ndim == 1:
        return lambda logits, yb: F.binary_cross_entropy_with_logits(
            logits.reshape(-1), yb, pos_weight=pos_weight.to(logits.device))

    def multilabel(logits: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        seen = ~torch.isnan(yb)
        per_entry = F.binary_cross_entropy_with_logits(
            logits.reshape(yb.shape), torch.where(seen, yb, torch.zeros_like(yb)), reduction="none",
            pos_weight=pos_weight.to(logits.device))
        mask = seen.to(per_entry.dtype)
        return (per_entry * mask).sum() / mask.sum().clamp(min=1.0)

    return multilabel


def train_local(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    settings: TrainSettings,
    *,
    seed: int,
    device: str | torch.device = "cpu",
    terms: GradTerms | None = None,
    task: TaskInfo = BINARY,
    amp: str | None = None,
) -> TrainStats:
    """Train `model` in place for `settings.epochs` passes over `(x, y)`.

    `x` has any rank, rows first (tables, images, ECG, sequences). The loss is `settings.loss`, or
    for "auto" the task's (`resolve_loss`); rows whose label is missing (NaN everywhere) are left
    out. Shuffling uses a `torch.Generator` seeded with `seed`; dropout uses the global RNG,
    reseeded inside a fork so the caller's RNG state is untouched. The optimizer is new on every
    call (docs/algorithms.md 0.5). `terms` adds the algorithm's client-side gradient terms
    (FedProx/FedPxN proximal, FedDyn, SCAFFOLD correction), anchored on the weights this call
    started from. `amp` ("bfloat16") runs forward and loss under autocast (CUDA sites; see usage.pick_amp).
    A regression with a log target (task.target = "log1p") learns log1p(y) with a squared error whatever
    the regression loss named ("mse", "msle", "auto"): on the labels' scale that is the MSLE of expm1(output)
    (fedmqtt.training.targets).

    Raises:
        ValueError: rows of x and y differ, or the labels do not fit the task or the loss.
        ConfigError: the loss does not fit the task (e.g. "ce" for a regression).
    """
    started = time.perf_counter()
    dev = _concrete(torch.device(device))
    model.to(dev).train()
    loss_name = resolve_loss(settings.loss, task)
    if is_log_target(task):
        loss_name = "mse"  # on log1p(y): the MSLE of expm1(output), never a second log
    loss_fn = make_loss(loss_name)
    xt, yt = _labelled_tensors(x, y, task, dev)
    if loss_name == "msle" and bool((yt < 0).any()):
        raise ValueError("msle needs targets >= 0 (docs/algorithms.md 17.3)")
    if settings.hyper.get("balance_classes", 0.0):  # off by default: results stay as they were
        loss_fn = balanced_loss(loss_name, yt, task)
    terms = terms or GradTerms()
    if terms.freeze_norm:
        _freeze_batchnorm(model)
    params = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    optimizer = _make_optimizer(params, settings)
    start = [p.detach().clone() for p in params]  # to tell a run that learnt nothing (warned below)
    correct = _gradient_terms(model, terms, dev)  # the algorithm's terms and FedDyn's clip, between backward and step
    shuffle = torch.Generator().manual_seed(seed)
    steps, loss_rows = 0, 0
    # The loss sum stays on the device: reading it back every step would make the host wait for the GPU
    # before it can queue the next step. float64 sums of float32 losses times batch sizes are exact in the
    # same way the host's float arithmetic was, so the mean comes out bit for bit as before.
    loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
    # Without AMP no autocast context at all: a disabled one changes nothing here (nothing trains under an outer
    # autocast) but costs its entry and exit every step.
    autocast = nullcontext() if amp is None else torch.autocast(dev.type, dtype=getattr(torch, amp))
    with _seeded_global_rng(seed, dev):
        for _ in range(settings.epochs):
            batches = _batches(xt.shape[0], settings.batch_size, shuffle, xt.device)
            for idx in itertools.islice(batches, settings.steps_per_epoch):
                xb, yb = _batch(xt, yt, idx, dev)
                optimizer.zero_grad()
                with autocast:
                    loss = loss_fn(model(xb).float(), yb)
                loss.backward()
                if correct is not None:
                    correct()
                optimizer.step()
                steps += 1
                loss_sum += loss.detach().double() * len(idx)
                loss_rows += len(idx)
    # NaN here (a diverged run) is reported as is; the caller decides what to do with it.
    mean_loss = float(loss_sum) / loss_rows if loss_rows else None
    if steps and not any(bool((p.detach() != p0).any()) for p, p0 in zip(params, start, strict=True)):
        log.warning("local training took %d step(s) and moved no weight (loss %s): its gradient is zero, "
                    "e.g. a regression whose outputs sit where the loss is flat, or lr too small", steps, mean_loss)
    why = "" if steps else _no_step_reason(int(xt.shape[0]), settings.batch_size)
    return TrainStats(int(xt.shape[0]), steps, mean_loss, time.perf_counter() - started, why)


def _no_step_reason(n_rows: int, batch_size: int) -> str:
    """Why a local round took no optimiser step (epochs and steps_per_epoch are >= 1, so: too few rows)."""
    if n_rows == 0:
        return "no labelled training row"
    return (f"{n_rows} labelled training row, and with batch_size {batch_size} a trailing batch of one row is "
            "dropped: BatchNorm cannot train on one sample (docs/algorithms.md 0.5)")


def _labelled_tensors(
    x: np.ndarray, y: np.ndarray, task: TaskInfo, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """x as float32 and y in the loss's dtype on `dev`, without rows whose label is entirely missing."""
    xa = np.asarray(x, dtype=np.float32)
    ya = np.asarray(y)
    if xa.ndim < 2 or ya.ndim < 1 or xa.shape[0] != ya.shape[0]:
        raise ValueError(f"features {xa.shape} and labels {ya.shape} do not match")
    if task.kind == "multilabel":
        ya = ya.astype(np.float32).reshape(ya.shape[0], -1)
        keep = ~np.isnan(ya).all(axis=1)
    elif task.kind == "multiclass":
        ya = ya.reshape(-1)
        keep = ~np.isnan(ya) if ya.dtype.kind == "f" else np.ones(ya.shape[0], bool)
        ya = np.where(keep, ya, 0).astype(np.int64)
    else:
        ya = to_model_scale(ya.astype(np.float32).reshape(-1), task)  # log1p(y) for a log target
        keep = ~np.isnan(ya)
    # Unlabelled rows take no part in training (docs/algorithms.md 17.1); with none missing nothing moves.
    if not keep.all():
        xa, ya = xa[keep], ya[keep]
    if dev.type == "cuda" and xa.nbytes > _GPU_RESIDENT_FRACTION * torch.cuda.mem_get_info(dev)[0]:
        # Too big to keep on the GPU: it stays in ordinary host memory (pinning all of it would lock as much
        # RAM again, every round); each batch is gathered into pinned memory and copied asynchronously (_batch).
        return torch.as_tensor(xa), torch.as_tensor(ya)
    # The usual case for these medical datasets: the whole training split lives on the device, so a
    # batch is one index operation there and the GPU never waits for the host.
    return torch.as_tensor(xa, device=dev), torch.as_tensor(ya, device=dev)


_GPU_RESIDENT_FRACTION = 0.25  # of the free GPU memory a site's training split may occupy


def _concrete(dev: torch.device) -> torch.device:
    """`cuda` as the GPU it means (`cuda:N`): tensors report their device with its index, and a comparison
    with an index-less `cuda` would send GPU-resident data down the host path (_batch)."""
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _batch(xt: torch.Tensor, yt: torch.Tensor, idx: torch.Tensor, dev: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    if xt.device == dev:
        idx = idx.to(dev)
        return xt[idx], yt[idx]
    # Host-resident data: gather into pinned memory so the copy is a DMA the next kernels overlap with.
    xb = torch.index_select(xt, 0, idx).pin_memory().to(dev, non_blocking=True)
    yb = torch.index_select(yt, 0, idx).pin_memory().to(dev, non_blocking=True)
    return xb, yb


def _batches(n: int, batch_size: int, generator: torch.Generator, device: torch.device
             ) -> Iterator[torch.Tensor]:
    # Drawn on the host (the same order on every device), then moved where the data lives once per epoch: a
    # host-to-GPU copy of each batch's indices would wait for the GPU's queued work every step.
    order = torch.randperm(n, generator=generator).to(device)
    for start in range(0, n, batch_size):
        idx = order[start : start + batch_size]
        # BatchNorm cannot train on one sample: drop a trailing batch of 1 (docs/algorithms.md 0.5).
        if len(idx) == 1 and batch_size > 1:
            continue
        yield idx


def _make_optimizer(params: list[nn.Parameter], settings: TrainSettings) -> LocalOptimiser:
    """The local optimiser: lr and weight_decay from `settings`, SGD momentum/nesterov from `settings.hyper`
    (strategies.params.LOCAL_OPTIMISER_KEYS; a setting that does not fit the optimiser is refused, never
    silently ignored). torch.optim's update rules; fedmqtt.training.optimisers says why not its classes."""
    try:
        check_local_optimiser(settings.hyper, settings.optimizer)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    if settings.optimizer == "sgd":
        return LocalOptimiser(params, "sgd", lr=settings.lr, weight_decay=settings.weight_decay,
                              momentum=float(settings.hyper.get("momentum", 0.0)),
                              nesterov=bool(settings.hyper.get("nesterov", 0.0)))
    return LocalOptimiser(params, settings.optimizer, lr=settings.lr, weight_decay=settings.weight_decay)


def _gradient_terms(model: nn.Module, terms: GradTerms, dev: torch.device) -> Callable[[], None] | None:
    """What runs between `backward()` and the optimiser's step: the algorithm's terms added to the gradients,
    and FedDyn's clip. None when there is nothing to do.

    Written into the gradient explicitly, so `mu`, `alpha` and the SCAFFOLD shift mean exactly what
    docs/algorithms.md says whatever the optimizer (never delegated to weight decay). FedDyn follows its
    authors' code (Acar et al., FedDyn) step for step: the gradient of the loss plus the linear term
    alpha * <w, s_i - w_send> is clipped to `clip_norm`, and only then is the quadratic term's alpha * w added
    (their optimiser's weight decay), so the clip never sees it. Unclipped, the sum is the paper's
    alpha * (s_i + w - w_send).
    """
    named = dict(model.named_parameters())
    prox = [n for n in terms.prox_names if n in named] if terms.prox_mu > 0 else []
    dyn = {n: torch.as_tensor(v, device=dev) for n, v in terms.dyn_s.items() if n in named}
    shift = {n: torch.as_tensor(v, device=dev) for n, v in terms.shift.items() if n in named}
    if not (prox or dyn or shift or terms.clip_norm > 0):
        return None
    anchor = {n: named[n].detach().clone() for n in {*prox, *dyn}}
    # FedDyn's linear coefficient s_i - w_send is fixed for the round: computed once, as the authors' code does.
    linear = {n: s - anchor[n] for n, s in dyn.items()}
    clipped = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]

    def apply() -> None:
        with torch.no_grad():
            for n in prox:
                _grad(named[n]).add_(named[n] - anchor[n], alpha=terms.prox_mu)
            for n, c in linear.items():
                _grad(named[n]).add_(c, alpha=terms.dyn_alpha)
            for n, c in shift.items():
                _grad(named[n]).add_(c)
        if terms.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(clipped, terms.clip_norm)
        with torch.no_grad():
            for n in dyn:
                _grad(named[n]).add_(named[n], alpha=terms.dyn_alpha)

    return apply


def _grad(p: torch.Tensor) -> torch.Tensor:
    """`p`'s gradient; zeros where the loss did not reach `p` (the algorithm's terms still apply to it)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _freeze_batchnorm(model: nn.Module) -> None:
    """FedFBN: BatchNorm runs on its pretrained statistics and is never trained (docs/algorithms.md 14)."""
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
