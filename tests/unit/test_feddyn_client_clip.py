"""FedDyn's local step in its authors' order of operations (Acar et al., FedDyn; docs/algorithms.md 6).

Their code takes, every step, the gradient of the task loss plus the linear term alpha * <w, s_i - w_send>,
clips THAT to max_grad_norm, and lets the optimiser's weight decay add (alpha + weight_decay) * w after the
clip. The reference below is written from that description alone, with its own forward pass, autograd on a
scalar loss and the clip by hand, and is compared with the site's code path (plan_terms -> gradient terms ->
LocalOptimiser, and train_local as a whole).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedmqtt.data.base import BINARY  # noqa: E402
from fedmqtt.strategies import build_strategy  # noqa: E402
from fedmqtt.training.client_rules import plan_terms  # noqa: E402
from fedmqtt.training.loop import _gradient_terms, train_local  # noqa: E402
from fedmqtt.training.models import tensor_manifest  # noqa: E402
from fedmqtt.training.optimisers import LocalOptimiser  # noqa: E402
from schemas.messages import TrainSettings  # noqa: E402

ALPHA, LR, WEIGHT_DECAY, CLIP, STEPS = 0.5, 0.2, 0.01, 0.5, 6
TORCH_CLIP_EPS = 1e-6  # clip_grad_norm_ divides by (total norm + 1e-6)


def _net(dtype: Any) -> Any:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).to(dtype)


def _data() -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(12, 3))
    y = (x[:, 0] + 0.3 * rng.normal(size=12) > 0).astype(np.float64)
    shapes = {n: tuple(p.shape) for n, p in _net(torch.float64).named_parameters()}
    s_i = {n: rng.normal(scale=2.0, size=shape) for n, shape in shapes.items()}  # a drift from earlier rounds
    return x, y, s_i


def _authors_steps(start: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, s_i: dict[str, np.ndarray],
                   *, weight_decay: float) -> tuple[dict[str, np.ndarray], list[float]]:
    """Full-batch SGD as the authors' FedDyn client does it, in float64; also each step's pre-clip norm."""
    send = {n: torch.tensor(v, dtype=torch.float64) for n, v in start.items()}
    w = {n: v.clone().requires_grad_(True) for n, v in send.items()}
    xt, yt = torch.tensor(x), torch.tensor(y)
    norms = []
    for _ in range(STEPS):
        logits = (torch.tanh(xt @ w["0.weight"].T + w["0.bias"]) @ w["2.weight"].T + w["2.bias"]).reshape(-1)
        task = torch.nn.functional.binary_cross_entropy_with_logits(logits, yt)
        linear = ALPHA * sum(torch.sum(w[n] * (torch.tensor(s_i[n]) - send[n])) for n in w)
        grads = dict(zip(w, torch.autograd.grad(task + linear, list(w.values())), strict=True))
        total = float(torch.sqrt(sum(torch.sum(g * g) for g in grads.values())))
        norms.append(total)
        scale = min(1.0, CLIP / (total + TORCH_CLIP_EPS))
        with torch.no_grad():
            for n in w:  # clipped gradient, then the optimiser's weight decay (alpha + weight_decay) * w
                w[n] -= LR * (grads[n] * scale + (ALPHA + weight_decay) * w[n])
    return {n: v.detach().numpy() for n, v in w.items()}, norms


def test_clipped_feddyn_step_matches_the_authors_order_to_1e12() -> None:
    """float64, clip active in every step: the site's gradient terms + SGD equal the reference to 1e-12."""
    # Prepare
    x, y, s_i = _data()
    model = _net(torch.float64)
    start = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    settings = TrainSettings(algorithm="feddyn", optimizer="sgd", lr=LR, weight_decay=WEIGHT_DECAY,
                             hyper={"alpha": ALPHA, "max_grad_norm": CLIP})
    terms = plan_terms(settings, tensor_manifest(model), extras={}, local={"s_i": s_i})
    correct = _gradient_terms(model, terms, torch.device("cpu"))
    assert correct is not None
    params = list(model.parameters())
    optimizer = LocalOptimiser(params, "sgd", lr=LR, weight_decay=WEIGHT_DECAY)
    xt, yt = torch.tensor(x), torch.tensor(y)
    # Execute
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(xt).reshape(-1), yt).backward()
        correct()
        optimizer.step()
    expected, norms = _authors_steps(start, x, y, s_i, weight_decay=WEIGHT_DECAY)
    # Assert
    assert min(norms) > 2 * CLIP  # the clip acted in every step
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), expected[name], rtol=0, atol=1e-12, err_msg=name)


def test_train_local_runs_feddyn_in_the_authors_order() -> None:
    """The whole local round (site_hyper -> plan_terms -> train_local, float32, one full batch per epoch)
    follows the same reference to float32 precision."""
    # Prepare
    x, y, s_i = _data()
    model = _net(torch.float32)
    start = {n: p.detach().numpy().astype(np.float64) for n, p in model.named_parameters()}
    hyper = build_strategy("feddyn", {"alpha": ALPHA, "max_grad_norm": CLIP,
                                      "scale_alpha_by_size": False}).site_hyper("a", {"a": 12, "b": 3})
    settings = TrainSettings(algorithm="feddyn", optimizer="sgd", lr=LR, epochs=STEPS, batch_size=len(y),
                             hyper=hyper)
    terms = plan_terms(settings, tensor_manifest(model), extras={},
                       local={"s_i": {n: v.astype(np.float32) for n, v in s_i.items()}})
    # Execute
    stats = train_local(model, x, y, settings, seed=0, terms=terms, task=BINARY)
    expected, norms = _authors_steps(start, x, y, {n: v.astype(np.float32).astype(np.float64)
                                                   for n, v in s_i.items()}, weight_decay=0.0)
    # Assert
    assert stats.steps == STEPS and min(norms) > 2 * CLIP
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), expected[name], rtol=0, atol=1e-6, err_msg=name)
