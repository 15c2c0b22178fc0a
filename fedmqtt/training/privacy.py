"""Record-level DP-SGD at the site (Abadi et al., Deep Learning with Differential Privacy), through one of three
engines: fused (fused_clipping.py), Opacus or torch.func (per_sample.py); `choose_engine` says which serves a model.

Each round: Poisson-sampled batches (every record joins a batch with probability q, as the accountant assumes),
each record's gradient clipped to C, Gaussian noise of std sigma * C on the batch's clipped sum, then the
site's optimiser. The accountant (Opacus' RDP or PRV) reads the history of (sigma, q, steps) of every round this
data ever served, so the epsilon a site reports covers all of them. docs/privacy.md says what this protects.

The noise and the sampling draw from a generator seeded with fresh OS randomness: a seed derived from the run's
seed, the site and the round (as plain training uses) is known to the PS, which could then regenerate the noise and
subtract it. Only tests pass a seed.
"""

from __future__ import annotations

import copy
import functools
import math
import secrets
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from fedmqtt.data.base import BINARY, TaskInfo
from fedmqtt.training.client_rules import record_dp_problem
from fedmqtt.training.loop import TrainStats, _batch, _concrete, _labelled_tensors, _make_optimizer, resolve_loss
from schemas.messages import RecordDP, TrainSettings

# (noise multiplier, sample rate, steps): Opacus' accountant history, the same for its RDP and PRV accountants.
HistoryEntry = tuple[float, float, int]


@dataclass(frozen=True)
class RoundPlan:
    """What one DP round will spend: its noise, sampling rate and expected steps, and epsilon once it is done."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    epsilon_before: float
    epsilon_after: float


@dataclass(frozen=True)
class DPRound:
    stats: TrainStats
    history: list[HistoryEntry]
    plan: RoundPlan
    epsilon: float  # after this round, by the accountant, at dp.delta
    engine: str = "opacus"  # which computed the per-record gradients (choose_engine)


def model_problem(model: nn.Module) -> str | None:
    """Why Opacus cannot clip this model's per-record gradients, with the fix; None when it can."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return None
    found = "; ".join(sorted({str(e).strip().split(". ")[0] for e in errors}))[:300]
    batchnorm = any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in model.modules())
    fix = ('build the model with norm = "gn" (GroupNorm) or "ln" (LayerNorm): BatchNorm mixes the records of a batch, '
           "so no record's gradient is its own and clipping bounds nothing") if batchnorm else \
        "use a model of the zoo whose layers Opacus supports (mlp, lenet5, resnet1d_se with norm gn or ln)"
    return f"record-level DP cannot train this model ({found}): {fix}"


def settings_problem(settings: TrainSettings) -> str | None:
    """Why DP-SGD cannot run with these settings; None when it can (client_rules.record_dp_problem)."""
    return record_dp_problem(settings.algorithm, settings.hyper)


def labelled_rows(y: np.ndarray, task: TaskInfo) -> int:
    """Rows DP-SGD trains on: those with a label (loop._labelled_tensors drops the others the same way)."""
    ya = np.asarray(y)
    if ya.dtype.kind != "f":
        return int(ya.shape[0])
    missing = np.isnan(ya.reshape(ya.shape[0], -1)).all(axis=1) if task.kind == "multilabel" else \
        np.isnan(ya.reshape(ya.shape[0], -1)).any(axis=1)
    return int((~missing).sum())


def sample_rate(n_rows: int, batch_size: int) -> float:
    """q = 1 / (batches per epoch), as Opacus' DPDataLoader sets it: the expected batch is `batch_size` rows."""
    return 1.0 / max(1, math.ceil(n_rows / batch_size))


def steps_per_round(n_rows: int, settings: TrainSettings) -> int:
    per_epoch = max(1, math.ceil(n_rows / settings.batch_size))
    if settings.steps_per_epoch is not None:
        per_epoch = min(per_epoch, settings.steps_per_epoch)
    return settings.epochs * per_epoch


def make_accountant(kind: str, history: Sequence[HistoryEntry]) -> Any:
    from opacus.accountants import PRVAccountant, RDPAccountant

    accountant = RDPAccountant() if kind == "rdp" else PRVAccountant()
    accountant.history = [(float(s), float(q), int(n)) for s, q, n in history]
    return accountant


def epsilon(history: Sequence[HistoryEntry], delta: float, kind: str = "rdp") -> float:
    """Epsilon at `delta` of everything in `history` (0 for none; inf where every step was noiseless)."""
    if not history:
        return 0.0
    if any(s == 0.0 for s, _, _ in history):
        return math.inf
    return _epsilon(tuple((float(s), float(q), int(n)) for s, q, n in history), float(delta), kind)


@functools.lru_cache(maxsize=64)
def _epsilon(history: tuple[HistoryEntry, ...], delta: float, kind: str) -> float:
    """Cached: the policy check and the round it admits ask for the same values (RDP's fractional orders cost
    tens of milliseconds a call, about a step's time on the small models)."""
    with _quiet():
        return float(make_accountant(kind, history).get_epsilon(delta=delta))


def noise_for(dp: RecordDP, q: float, round_steps: int) -> float:
    """sigma: the configured one, or the one that spends `target_epsilon` over the planned rounds at rate q."""
    if dp.noise_multiplier is not None:
        return dp.noise_multiplier
    from opacus.accountants.utils import get_noise_multiplier

    assert dp.target_epsilon is not None  # RecordDP holds one of the two
    total = round_steps * (dp.planned_rounds or 1)
    try:
        with _quiet():
            return float(get_noise_multiplier(target_epsilon=dp.target_epsilon, target_delta=dp.delta,
                                              sample_rate=q, steps=total, accountant=dp.accountant))
    except ValueError as exc:  # Opacus: "The privacy budget is too low."
        hint = (": its RDP orders stop at 63, which bounds epsilon below by about log(1 / delta) / 62; use "
                "accountant = \"prv\"") if dp.accountant == "rdp" else ""
        raise ValueError(f"target_epsilon {dp.target_epsilon:g} at delta {dp.delta:g} is below what Opacus' "
                         f"{dp.accountant} accountant can certify for any noise ({exc}){hint}") from None


def plan_round(dp: RecordDP, n_rows: int, settings: TrainSettings, history: Sequence[HistoryEntry]) -> RoundPlan:
    """What the next round will spend, computed by the accountant before a single record is touched (the site's
    policy refuses a round whose epsilon_after exceeds its max_epsilon)."""
    q = sample_rate(n_rows, settings.batch_size)
    steps = steps_per_round(n_rows, settings)
    sigma = noise_for(dp, q, steps)
    before = epsilon(history, dp.delta, dp.accountant)
    after = epsilon([*history, (sigma, q, steps)], dp.delta, dp.accountant)
    return RoundPlan(sigma, q, steps, before, after)


def train_local_dp(model: nn.Module, x: np.ndarray, y: np.ndarray, settings: TrainSettings, dp: RecordDP, *,
                   history: Sequence[HistoryEntry], device: str | torch.device = "cpu", task: TaskInfo = BINARY,
                   seed: int | None = None) -> DPRound:
    """Train `model` in place with DP-SGD for `settings.epochs` epochs; return the accountant's new history.

    `seed` fixes the Poisson sampling and the noise (tests only: see the module's docstring).

    Raises:
        ValueError: the model or the settings cannot be trained with DP (the message says how to fix it), or the
            labels do not fit the task.
    """
    problem = settings_problem(settings) or model_problem(model)
    if problem:
        raise ValueError(problem)
    started = time.perf_counter()
    dev = torch.device(device)
    criterion = PerRecordLoss(resolve_loss(settings.loss, task))
    xt, yt = _labelled_tensors(x, y, task, dev)
    n = int(xt.shape[0])
    plan = plan_round(dp, n, settings, history)
    draw = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
    noise = torch.Generator(device=dev).manual_seed(secrets.randbits(63) if seed is None else seed + 1)
    per_epoch = max(1, math.ceil(n / settings.batch_size))
    if settings.steps_per_epoch is not None:
        per_epoch = min(per_epoch, settings.steps_per_epoch)
    chosen = choose_engine(dp.engine, model, int(n * plan.sample_rate))
    if n == 0:  # nothing to sample from (Opacus' sampler refuses it): no step, nothing spent
        stats = TrainStats(0, 0, None, time.perf_counter() - started, "no labelled training row")
        return DPRound(stats, [(float(s), float(q), int(k)) for s, q, k in history], plan, plan.epsilon_before, chosen)
    if chosen == "fused":  # trains the model's own weights: it wraps nothing and adds no hook to it
        was_training = model.to(dev).training
        model.train()  # for dropout layers, which the fused engine calls as they are
        try:
            steps, loss_sum, loss_rows, new_history = _fused_round(model, _concrete(dev), settings, criterion, xt, yt,
                                                                   draw, per_epoch, dp, plan, history, noise)
        finally:
            model.train(was_training)
    else:
        steps, loss_sum, loss_rows, new_history = _wrapped_round(chosen, model, settings, criterion, xt, yt, draw,
                                                                 per_epoch, dp, plan, history, noise)
    # The plan counted exactly the steps taken (the Poisson loader yields a fixed number of batches per epoch).
    planned = [*history, (plan.noise_multiplier, plan.sample_rate, plan.steps)]
    eps = plan.epsilon_after if _merged(new_history) == _merged(planned) else epsilon(new_history, dp.delta,
                                                                                        dp.accountant)
    stats = TrainStats(n, steps, loss_sum / loss_rows if loss_rows else None, time.perf_counter() - started,
                       "" if steps else "no labelled training row")
    return DPRound(stats, new_history, plan, eps, chosen)


def _wrapped_round(chosen: str, model: nn.Module, settings: TrainSettings, criterion: PerRecordLoss,
                   xt: torch.Tensor, yt: torch.Tensor, draw: torch.Generator, per_epoch: int, dp: RecordDP,
                   plan: RoundPlan, history: Sequence[HistoryEntry], noise: torch.Generator
                   ) -> tuple[int, float, int, list[HistoryEntry]]:
    """The round through Opacus or torch.func on a copy of the model, whose weights are copied back after."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    n = int(xt.shape[0])
    # A copy is wrapped, so the trainer's cached model never carries Opacus' hooks into plain training or evaluation.
    work = copy.deepcopy(model).to(xt.device).train()
    optimizer = _torch_optimizer(work, settings)
    # Read by make_private only for q = 1 / len(loader) and the expected batch n * q; the batches come from
    # Opacus' Poisson sampler below, indexing the tensors directly (a DataLoader fetches row by row, which cost
    # about a quarter of a DP step on the zoo's MLP).
    loader = DataLoader(TensorDataset(xt, yt), batch_size=settings.batch_size)
    sampler = UniformWithReplacementSampler(num_samples=n, sample_rate=plan.sample_rate, generator=draw,
                                            steps=per_epoch)
    with _quiet():
        if chosen == "opacus":
            out = _opacus_round(work, optimizer, loader, sampler, criterion, xt, yt, settings.epochs, dp, plan,
                                history, noise)
        else:
            out = _torch_func_round(work, optimizer, sampler, criterion, xt, yt, settings.epochs, dp, plan,
                                    history, noise)
    model.load_state_dict(_unwrapped(work.state_dict()))
    return out


def _fused_round(model: nn.Module, device: torch.device, settings: TrainSettings, criterion: PerRecordLoss,
                 xt: torch.Tensor, yt: torch.Tensor, draw: torch.Generator, per_epoch: int, dp: RecordDP,
                 plan: RoundPlan, history: Sequence[HistoryEntry], noise: torch.Generator
                 ) -> tuple[int, float, int, list[HistoryEntry]]:
    """The round through the fused engine (fused_clipping.py) on a flat copy of the model's parameters, written
    back after. The same Poisson sampling as Opacus' UniformWithReplacementSampler (the same draws from `draw`:
    each record joins with probability q), without its round trip through a Python list of indices."""
    from fedmqtt.training.fused_clipping import FusedDPSGD, accountant_history

    per_record = PerRecordLoss(criterion.name)
    per_record.reduction = "none"
    n = int(xt.shape[0])
    # forward, not the module's call: no hooks to run, a few microseconds a step on models whose step is hundreds
    engine = FusedDPSGD(model, per_record.forward, lambda params: _make_optimizer(params, settings),
                        max_grad_norm=dp.max_grad_norm, noise_multiplier=plan.noise_multiplier,
                        # at least 1: n * (1 / n) can round to just below 1 (batch size 1), and int() to 0
                        expected_batch_size=max(1, int(n * plan.sample_rate)), generator=noise)
    resident = xt.device == device
    steps, loss_rows = 0, 0
    for _ in range(settings.epochs):
        for _ in range(per_epoch):
            chosen = torch.rand(n, generator=draw) < plan.sample_rate
            if resident and device.type == "cpu":  # a boolean mask indexes in one operation per tensor
                loss_rows += engine.step(xt[chosen], yt[chosen])
            else:
                loss_rows += engine.step(*_batch(xt, yt, chosen.nonzero().reshape(-1), device))
            steps += 1
    engine.write_back()
    new_history = accountant_history(history, plan.noise_multiplier, plan.sample_rate, steps)
    return steps, float(engine.loss_sum), loss_rows, new_history


Engine = Literal["fused", "opacus", "torch.func"]
# The rule "auto" follows (bench/dp_step.py; docs/benchmarks.md "DP-SGD step time"): the fused engine wherever it
# serves the model (one backward pass, no hooks, no materialised gradient of a Linear layer: the fastest of the three
# on every model measured); else torch.func where it was measured faster than Opacus, on convolutional models (LeNet-5
# with GroupNorm: about a tenth faster than ghost clipping, whose per-record norms of a convolution unfold its
# input), as long as a batch of per-record gradients stays small; Opacus' ghost clipping otherwise: on Linear layers
# its norms are cheap and torch.func's materialised gradients are not.
AUTO_MAX_GRADIENT_FLOATS = 1 << 23  # expected batch x trainable parameters: 8 Mi floats, 32 MiB in float32


def choose_engine(requested: str, model: nn.Module, expected_batch_size: int = 0) -> Engine:
    """The engine that computes the per-record gradients: the one requested, or for "auto" the rule above.

    Raises:
        ValueError: torch.func or fused was requested for a model with layers it does not serve (the message says
            which and what to use instead).
    """
    from fedmqtt.training import fused_clipping
    from fedmqtt.training.per_sample import unsupported

    if requested == "opacus":
        return "opacus"
    if requested == "fused":
        why = fused_clipping.problem(model)
        if why:
            raise ValueError(f"train.dp.engine = \"fused\": {why}")
        return "fused"
    missing = unsupported(model)
    if requested == "torch.func":
        if missing:
            raise ValueError(f"train.dp.engine = \"torch.func\" cannot serve layers {', '.join(missing)}: use "
                             "engine = \"opacus\" or \"auto\"")
        return "torch.func"
    if fused_clipping.problem(model) is None:
        return "fused"
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    small = max(1, expected_batch_size) * n_params <= AUTO_MAX_GRADIENT_FLOATS
    convolutional = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return "torch.func" if not missing and small and convolutional else "opacus"


def _opacus_round(work: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader[Any], sampler: Any,
                  criterion: PerRecordLoss, xt: torch.Tensor, yt: torch.Tensor, epochs: int, dp: RecordDP,
                  plan: RoundPlan, history: Sequence[HistoryEntry], noise: torch.Generator
                  ) -> tuple[int, float, int, list[HistoryEntry]]:
    """The round's steps through Opacus; (steps, loss sum, rows, the accountant's new history)."""
    from opacus import PrivacyEngine

    n = int(xt.shape[0])
    steps, loss_sum, loss_rows = 0, 0.0, 0
    engine = PrivacyEngine(accountant=dp.accountant)
    engine.accountant.history = [(float(s), float(q), int(k)) for s, q, k in history]
    # Ghost clipping (Li et al., Large language models can be strong differentially private learners; Bu et
    # al.): each record's gradient norm without materialising the per-record gradients, then a second backward
    # pass with the clipped weights. On the zoo's MLP about 15 times faster than per-sample gradients (hooks).
    private, dp_optimizer, dp_loss, _ = engine.make_private(
        module=work, optimizer=optimizer, data_loader=loader, noise_multiplier=plan.noise_multiplier,
        max_grad_norm=dp.max_grad_norm, poisson_sampling=False, noise_generator=noise, criterion=criterion,
        grad_sample_mode="ghost")
    if dp_optimizer.expected_batch_size != int(n * plan.sample_rate):
        raise RuntimeError("Opacus' expected batch size differs from the plan's sampling rate")
    for _ in range(epochs):
        for rows in sampler:  # each record independently with probability q: possibly none
            idx = torch.as_tensor(rows, dtype=torch.long, device=xt.device)
            xb, yb = xt[idx], yt[idx]
            dp_optimizer.zero_grad()
            loss = dp_loss(private(xb).float(), yb)
            loss.backward()  # both of ghost clipping's passes
            dp_optimizer.step()  # clips, noises, steps; the accountant records it (an empty batch too)
            steps += 1
            if len(yb):
                loss_sum += float(loss.detach()) * len(yb)
                loss_rows += len(yb)
    return steps, loss_sum, loss_rows, list(engine.accountant.history)


def _torch_func_round(work: nn.Module, optimizer: torch.optim.Optimizer, sampler: Any, criterion: PerRecordLoss,
                      xt: torch.Tensor, yt: torch.Tensor, epochs: int, dp: RecordDP, plan: RoundPlan,
                      history: Sequence[HistoryEntry], noise: torch.Generator
                      ) -> tuple[int, float, int, list[HistoryEntry]]:
    """The same round with per-record gradients from torch.func (per_sample.py), the same Poisson sampler, noise
    generator and Opacus accountant, which records each step as Opacus' optimiser hook does."""
    from fedmqtt.training.per_sample import PerRecordGradients, dp_step

    per_record = PerRecordLoss(criterion.name)
    per_record.reduction = "none"
    gradients = PerRecordGradients(work, per_record)
    accountant = make_accountant(dp.accountant, history)
    expected = int(int(xt.shape[0]) * plan.sample_rate)
    steps, loss_sum, loss_rows = 0, 0.0, 0
    for _ in range(epochs):
        for rows in sampler:
            idx = torch.as_tensor(rows, dtype=torch.long, device=xt.device)
            xb, yb = xt[idx], yt[idx]
            optimizer.zero_grad()
            losses = dp_step(gradients, optimizer, xb, yb, max_grad_norm=dp.max_grad_norm,
                             noise_multiplier=plan.noise_multiplier, expected_batch_size=expected, generator=noise)
            accountant.step(noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate)
            steps += 1
            if len(yb):
                loss_sum += float(losses.sum())
                loss_rows += len(yb)
    return steps, loss_sum, loss_rows, list(accountant.history)


class PerRecordLoss(nn.Module):
    """The site's loss (loop.make_loss) as ghost clipping needs it: one value per record with reduction "none",
    their mean with "mean". Multi-label partial labels: each record's mean over its annotated labels (plain
    training divides by the batch's annotated labels instead; with DP each record's loss must be its own)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.reduction = "mean"

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_record = self._per_record(out, y)
        return per_record if self.reduction == "none" else per_record.mean() if self.reduction == "mean" else \
            per_record.sum()

    def _per_record(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.name == "ce":
            return F.cross_entropy(out, y, reduction="none")
        if self.name == "bce":
            if y.ndim == 1:
                return F.binary_cross_entropy_with_logits(out.reshape(-1), y, reduction="none")
            seen = ~torch.isnan(y)
            target = torch.where(seen, y, torch.zeros_like(y))
            entries = F.binary_cross_entropy_with_logits(out.reshape(y.shape), target, reduction="none")
            mask = seen.to(entries.dtype)
            return (entries * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        pred = out.reshape(y.shape)
        if self.name == "msle":  # as loop._msle: the value of max(pred, 0), the gradient straight through
            clamped = pred.clamp(min=0.0)
            pred = torch.log1p(clamped + torch.where(pred < 0, pred - pred.detach(), torch.zeros_like(pred)))
            y = torch.log1p(y)
        return ((pred - y) ** 2).reshape(y.shape[0], -1).mean(dim=1)


def _unwrapped(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's own state-dict keys (Opacus' wrapper may prefix them with `_module.`)."""
    return {k.removeprefix("_module."): v for k, v in state.items()}


def _merged(history: Sequence[HistoryEntry]) -> list[HistoryEntry]:
    """Consecutive entries of equal noise and rate as one (how Opacus' accountant records steps)."""
    out: list[HistoryEntry] = []
    for s, q, n in history:
        if out and out[-1][:2] == (s, q):
            out[-1] = (s, q, out[-1][2] + n)
        else:
            out.append((s, q, n))
    return out


def _torch_optimizer(model: nn.Module, settings: TrainSettings) -> torch.optim.Optimizer:
    """torch.optim's class (Opacus' DPOptimizer wraps one), with the site's optimiser settings."""
    params = [p for p in model.parameters() if p.requires_grad]
    if settings.optimizer == "sgd":
        return torch.optim.SGD(params, lr=settings.lr, weight_decay=settings.weight_decay,
                               momentum=float(settings.hyper.get("momentum", 0.0)),
                               nesterov=bool(settings.hyper.get("nesterov", 0.0)))
    kind = torch.optim.Adam if settings.optimizer == "adam" else torch.optim.AdamW
    return kind(params, lr=settings.lr, weight_decay=settings.weight_decay)


@contextmanager
def _quiet() -> Iterator[None]:
    """Opacus' known warnings, each with why it does not apply here."""
    with warnings.catch_warnings():
        # secure_mode needs torchcsprng; the generators are seeded from the OS's randomness instead (docstring).
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        # torch warns when a module's inputs need no gradient (the first layer's): Opacus' hooks read activations.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        # the RDP accountant's optimal order at the edge of its default alphas: epsilon is still an upper bound.
        warnings.filterwarnings("ignore", message="Optimal order is the")
        # PRV's log(1 - q) for a step at q = 1 (a label histogram's release, fedmqtt/training/histogram_dp.py):
        # a term that q = 1 leaves unused; the epsilon is right (tests/unit/test_histogram_dp.py)
        warnings.filterwarnings("ignore", message="divide by zero encountered in log", category=RuntimeWarning)
        yield
