"""DP-SGD's torch.func engine (fedmqtt/training/per_sample.py) against Opacus and against single-record backward
passes: the same per-record gradients, the same clipped and noised step, the same accountant ledger."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from fedmqtt.data.base import BINARY, TaskInfo  # noqa: E402
from fedmqtt.training import per_sample, privacy  # noqa: E402
from fedmqtt.training.models import build_model  # noqa: E402
from schemas.messages import RecordDP, TrainSettings  # noqa: E402

MULTICLASS = TaskInfo("multiclass", 10)
# (registry name, args, one row's shape, task)
CASES = {
    "mlp": ("mlp", {"in_features": 15, "hidden": [32, 32]}, (15,), BINARY),
    "lenet-gn": ("lenet5", {"n_classes": 10, "norm": "gn"}, (1, 28, 28), MULTICLASS),
}


def _data(shape: tuple[int, ...], task: TaskInfo, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *shape)).astype(np.float32)
    if task.kind == "binary":
        return x, (x.reshape(n, -1)[:, 0] > 0).astype(np.float32)
    return x, rng.integers(0, task.n_outputs, size=n)


def _model(case: str) -> torch.nn.Module:
    name, args, _, _ = CASES[case]
    torch.manual_seed(1)
    return build_model(name, args)


def _record_loss(task: TaskInfo) -> privacy.PerRecordLoss:
    loss = privacy.PerRecordLoss("bce" if task.kind == "binary" else "ce")
    loss.reduction = "none"
    return loss


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_record_gradients_equal_single_record_backward_passes(case: str) -> None:
    _, _, shape, task = CASES[case]
    model = _model(case)
    x, y = _data(shape, task, 6)
    xt = torch.as_tensor(x)
    yt = torch.as_tensor(y if task.kind == "binary" else y.astype(np.int64))
    loss = _record_loss(task)
    grads, losses = per_sample.per_record_gradients(model, loss, xt, yt)
    for i in range(len(yt)):
        model.zero_grad()
        one = loss(model(xt[i:i + 1]).float(), yt[i:i + 1])[0]
        one.backward()
        assert float(losses[i]) == pytest.approx(float(one.detach()), rel=1e-5)
        for name, p in model.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(grads[name][i], p.grad, rtol=1e-4, atol=1e-6)


def test_clipping_bounds_each_record_and_leaves_small_gradients_alone() -> None:
    g = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]]), "b": torch.zeros(2, 1)}  # norms 5 and 0.5
    summed = per_sample.clipped_sum(g, max_grad_norm=1.0)
    expected = torch.tensor([3.0, 4.0]) / (5.0 + 1e-6) + torch.tensor([0.3, 0.4])
    torch.testing.assert_close(summed["w"], expected)
    torch.testing.assert_close(summed["b"], torch.zeros(1))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_one_step_of_both_engines_gives_the_same_parameters(case: str, sigma: float) -> None:
    """One Poisson-sampled step from the same seed: the same records, the same clipping, and (sigma 1) the same
    noise drawn from the same generator, so the parameters agree to float tolerance."""
    _, _, shape, task = CASES[case]
    x, y = _data(shape, task, 96)
    settings = TrainSettings(epochs=1, batch_size=32, lr=0.1, optimizer="sgd", steps_per_epoch=1,
                             loss="bce" if task.kind == "binary" else "ce")
    start = _model(case)
    results = {}
    for engine in ("opacus", "torch.func"):
        model = _model(case)
        dp = RecordDP(max_grad_norm=0.5, noise_multiplier=sigma, engine=engine)
        done = privacy.train_local_dp(model, x, y, settings, dp, history=[], task=task, seed=4)
        assert done.engine == engine and done.stats.steps == 1
        results[engine] = (model, done)
    (a, ra), (b, rb) = results["opacus"], results["torch.func"]
    moved = sum(float((p - q).detach().abs().sum()) for p, q in zip(a.parameters(), start.parameters(), strict=True))
    assert moved > 0  # the step did something
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    assert ra.history == rb.history and ra.epsilon == rb.epsilon
    assert ra.stats.mean_loss == pytest.approx(rb.stats.mean_loss, rel=1e-5)


def test_a_round_of_many_steps_keeps_the_same_ledger_and_parameters() -> None:
    x, y = _data((15,), BINARY, 200)
    settings = TrainSettings(epochs=2, batch_size=25, lr=0.05, optimizer="sgd", hyper={"momentum": 0.9})
    history = [(1.3, 0.05, 7)]
    out = []
    for engine in ("opacus", "torch.func"):
        model = _model("mlp")
        dp = RecordDP(max_grad_norm=1.0, noise_multiplier=1.0, engine=engine, accountant="prv")
        out.append((model, privacy.train_local_dp(model, x, y, settings, dp, history=history, seed=9)))
    (a, ra), (b, rb) = out
    assert ra.history == rb.history == [(1.3, 0.05, 7), (1.0, 1 / 8, 16)]
    assert ra.epsilon == rb.epsilon
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_an_empty_batch_steps_by_the_noise_alone() -> None:
    model = _model("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    gen = torch.Generator().manual_seed(2)
    gradients = per_sample.PerRecordGradients(model, _record_loss(BINARY))
    per_sample.dp_step(gradients, opt, torch.zeros(0, 15), torch.zeros(0), max_grad_norm=2.0, noise_multiplier=1.5,
                       expected_batch_size=4, generator=gen)
    replay = torch.Generator().manual_seed(2)
    for p, b in zip(model.parameters(), before, strict=True):
        noise = torch.normal(mean=0, std=3.0, size=p.shape, generator=replay)
        torch.testing.assert_close(p.detach(), b - noise / 4)


def test_the_engine_rule() -> None:
    """Past the fused engine (tests/unit/test_dp_fused.py), which serves the zoo's chains: torch.func for a small
    convolutional model it serves, Opacus otherwise."""
    mlp, lenet = _model("mlp"), _model("lenet-gn")
    assert privacy.choose_engine("auto", lenet, 64) == "fused"
    assert privacy.choose_engine("auto", mlp, 64) == "fused"
    resnet = build_model("resnet1d_se", {"in_leads": 1, "base": 8, "blocks": [1], "norm": "gn"})  # residual: no chain
    assert privacy.choose_engine("auto", resnet, 64) == "torch.func"  # convolutional and small: measured faster
    assert privacy.choose_engine("auto", resnet, 8192) == "opacus"  # 8192 x 1149 per-record gradients: too many
    assert privacy.choose_engine("torch.func", mlp, 64) == "torch.func"
    assert privacy.choose_engine("opacus", lenet, 64) == "opacus"
    gru = build_model("gru", {"n_features": 3, "hidden": 8})
    assert per_sample.unsupported(gru)
    assert privacy.choose_engine("auto", gru, 8) == "opacus"
    with pytest.raises(ValueError, match="cannot serve layers"):
        privacy.choose_engine("torch.func", gru, 8)
