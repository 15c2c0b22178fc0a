"""DP-SGD's fused engine (fedmqtt/training/fused_clipping.py) against torch.func's per-record gradients and Opacus:
the same per-record norms and clipped sums, the same steps and ledger with the noise off, noise of the configured
scale with it on, and the models it refuses."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from torch import nn  # noqa: E402

from fedmqtt.data.base import BINARY, TaskInfo  # noqa: E402
from fedmqtt.training import fused_clipping, per_sample, privacy  # noqa: E402
from fedmqtt.training.models import build_model  # noqa: E402
from fedmqtt.training.weights import state_to_arrays  # noqa: E402
from schemas.messages import RecordDP, TrainSettings  # noqa: E402

MULTICLASS = TaskInfo("multiclass", 10)
# (registry name, args, one row's shape, task)
CASES = {
    "mlp": ("mlp", {"in_features": 15, "hidden": [32, 32]}, (15,), BINARY),
    "mlp-ln": ("mlp", {"in_features": 15, "hidden": [32, 16], "norm": "ln"}, (15,), BINARY),
    "mlp-gn-10": ("mlp", {"in_features": 20, "hidden": [24], "norm": "gn", "out_features": 10}, (20,), MULTICLASS),
    "lenet-gn": ("lenet5", {"n_classes": 10, "norm": "gn"}, (1, 28, 28), MULTICLASS),
    "lenet-ln": ("lenet5", {"n_classes": 10, "norm": "ln"}, (1, 28, 28), MULTICLASS),
    "lenet-plain": ("lenet5", {"n_classes": 10, "in_channels": 3, "image_size": 16}, (3, 16, 16), MULTICLASS),
}


def _conv1d_sequence() -> nn.Module:
    """Layers beyond the zoo's defaults: Conv1d with stride, dilation and no bias, GroupNorm without affine
    parameters, a LayerNorm over two axes, and a Linear on a sequence per record (3-D inputs)."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Conv1d(3, 8, 3, stride=2, padding=1, dilation=2, bias=False), nn.GroupNorm(2, 8),
                         nn.GroupNorm(4, 8, affine=False), nn.Tanh(), nn.LayerNorm([8, 9]), nn.Linear(9, 4),
                         nn.ReLU(), nn.Flatten(), nn.Sequential(nn.Linear(32, 10)))


def _data(shape: tuple[int, ...], task: TaskInfo, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *shape)).astype(np.float32)
    if task.kind == "binary":
        return x, (x.reshape(n, -1)[:, 0] > 0).astype(np.float32)
    return x, rng.integers(0, task.n_outputs, size=n)


def _model(case: str) -> nn.Module:
    if case == "conv1d-seq":
        return _conv1d_sequence()
    name, args, _, _ = CASES[case]
    torch.manual_seed(1)
    return build_model(name, args)


def _case(case: str) -> tuple[tuple[int, ...], TaskInfo]:
    return ((3, 20), MULTICLASS) if case == "conv1d-seq" else CASES[case][2:]


def _record_loss(task: TaskInfo) -> privacy.PerRecordLoss:
    loss = privacy.PerRecordLoss("bce" if task.kind == "binary" else "ce")
    loss.reduction = "none"
    return loss


def _tensors(x: np.ndarray, y: np.ndarray, task: TaskInfo) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.as_tensor(x), torch.as_tensor(y if task.kind == "binary" else y.astype(np.int64))


ALL = [*sorted(CASES), "conv1d-seq"]


@pytest.mark.parametrize("case", ALL)
def test_the_chain_is_the_models_forward(case: str) -> None:
    """The engine drives the layers by hand: its output must be the model's own, in training mode too (dropout
    draws from the same global generator in the same order)."""
    shape, task = _case(case)
    model = _model(case)
    x, _ = _data(shape, task, 5)
    engine = fused_clipping.FusedDPSGD(model, _record_loss(task), lambda ps: privacy._make_optimizer(ps, _SGD),
                                       max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=5,
                                       generator=torch.Generator())
    out, _, _ = engine.forward(torch.as_tensor(x))
    torch.testing.assert_close(out, model(torch.as_tensor(x)), rtol=1e-5, atol=1e-6)


def test_dropout_draws_each_records_mask_as_the_model_does() -> None:
    torch.manual_seed(1)
    model = build_model("mlp", {"in_features": 15, "hidden": [32, 32], "dropout": 0.5}).train()
    x = torch.randn(8, 15)
    engine = fused_clipping.FusedDPSGD(model, _record_loss(BINARY), lambda ps: privacy._make_optimizer(ps, _SGD),
                                       max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=8,
                                       generator=torch.Generator())
    torch.manual_seed(5)
    ours = engine.forward(x)[0]
    torch.manual_seed(5)
    torch.testing.assert_close(ours, model(x))
    assert not torch.equal(ours, model.eval()(x))  # the masks did something


_SGD = TrainSettings(optimizer="sgd", lr=0.1)


@pytest.mark.parametrize("case", ALL)
@pytest.mark.parametrize("clip", [1e-2, 1e3])  # every record clipped; none clipped
def test_norms_and_clipped_sums_equal_torch_funcs_per_record_gradients(case: str, clip: float) -> None:
    shape, task = _case(case)
    model = _model(case)
    xt, yt = _tensors(*_data(shape, task, 9), task)
    loss = _record_loss(task)
    norms, summed = fused_clipping.per_record_factors(model, loss, xt, yt, clip)
    grads, _ = per_sample.per_record_gradients(model, loss, xt, yt)
    expected_norms = torch.stack([g.reshape(9, -1).norm(dim=1) for g in grads.values()], dim=1).norm(dim=1)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-4, atol=1e-6)
    expected = per_sample.clipped_sum(grads, clip)
    assert summed.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(summed[k], expected[k], rtol=1e-4, atol=1e-6 * max(1.0, min(clip, 10.0)))


@pytest.mark.parametrize("case", ["mlp", "lenet-gn"])
def test_one_step_without_noise_equals_opacus(case: str) -> None:
    shape, task = _case(case)
    x, y = _data(shape, task, 96)
    settings = TrainSettings(epochs=1, batch_size=32, lr=0.1, optimizer="sgd", steps_per_epoch=1,
                             loss="bce" if task.kind == "binary" else "ce")
    start = _model(case)
    results = {}
    for engine in ("opacus", "fused"):
        model = _model(case)
        dp = RecordDP(max_grad_norm=0.5, noise_multiplier=0.0, engine=engine)
        done = privacy.train_local_dp(model, x, y, settings, dp, history=[], task=task, seed=4)
        assert done.engine == engine and done.stats.steps == 1
        results[engine] = (model, done)
    (a, ra), (b, rb) = results["opacus"], results["fused"]
    moved = sum(float((p - q).detach().abs().sum()) for p, q in zip(a.parameters(), start.parameters(), strict=True))
    assert moved > 0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    assert ra.history == rb.history and ra.epsilon == rb.epsilon
    assert ra.stats.mean_loss == pytest.approx(rb.stats.mean_loss, rel=1e-5)


@pytest.mark.parametrize(("optimizer", "hyper"), [("sgd", {"momentum": 0.9}), ("adam", {})])
def test_a_round_of_many_steps_without_noise_equals_opacus(optimizer: str, hyper: dict[str, float]) -> None:
    x, y = _data((15,), BINARY, 200)
    settings = TrainSettings(epochs=2, batch_size=25, lr=0.05, optimizer=optimizer, hyper=hyper)
    history = [(1.3, 0.05, 7), (0.0, 1 / 8, 3)]  # a noiseless entry last: the round's own noise differs from it
    out = []
    for engine in ("opacus", "fused"):
        model = _model("mlp")
        dp = RecordDP(max_grad_norm=1.0, noise_multiplier=0.0, engine=engine, accountant="prv")
        out.append((model, privacy.train_local_dp(model, x, y, settings, dp, history=history, seed=9)))
    (a, ra), (b, rb) = out
    assert ra.history == rb.history == [*history[:1], (0.0, 1 / 8, 19)]
    assert ra.epsilon == rb.epsilon == math.inf
    assert ra.stats.steps == rb.stats.steps == 16
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("history", "sigma", "q", "steps"), [
    ([], 1.0, 0.1, 5), ([(1.0, 0.1, 3)], 1.0, 0.1, 4), ([(1.0, 0.1, 3)], 1.1, 0.1, 2), ([(1.0, 0.2, 3)], 1.0, 0.1, 1),
])
def test_the_ledger_is_opacus_step_by_step(history: list[tuple[float, float, int]], sigma: float, q: float,
                                           steps: int) -> None:
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = list(history)
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    assert fused_clipping.accountant_history(history, sigma, q, steps) == accountant.history


def test_the_records_are_opacus_poisson_samples() -> None:
    """The fused round draws its batches itself; they are the records Opacus' sampler picks from the same seed."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    x, y = _data((15,), BINARY, 120)
    settings = TrainSettings(epochs=1, batch_size=40, lr=1.0, optimizer="sgd")
    seen: list[list[int]] = []
    original = fused_clipping.FusedDPSGD.step

    def spy(self: fused_clipping.FusedDPSGD, xb: torch.Tensor, yb: torch.Tensor) -> int:
        rows = [int(np.flatnonzero((x == xb[i].numpy()).all(axis=1))[0]) for i in range(len(xb))]
        seen.append(rows)
        return original(self, xb, yb)

    fused_clipping.FusedDPSGD.step = spy  # type: ignore[method-assign]
    try:
        privacy.train_local_dp(_model("mlp"), x, y, settings, RecordDP(max_grad_norm=1.0, noise_multiplier=1.0,
                               engine="fused"), history=[], seed=11)
    finally:
        fused_clipping.FusedDPSGD.step = original  # type: ignore[method-assign]
    sampler = UniformWithReplacementSampler(num_samples=120, sample_rate=1 / 3, generator=torch.Generator()
                                            .manual_seed(11), steps=3)
    assert seen == list(sampler)


@pytest.mark.parametrize("hidden", [[128], [256, 256]])
def test_the_noise_has_the_configured_scale(hidden: list[int]) -> None:
    """One step where the noise dwarfs the clipped sum (at most B * C = 0.64 in norm; the noise's norm is about
    sigma * C * sqrt(d), hundreds of times more): each coordinate's move is -lr * noise / B, so move / (lr * sigma *
    C / B) must be standard normal. Checked on thousands of coordinates with bounds that a wrong scale, a wrong
    divisor or noise drawn once for all parameters would break: the sample std within 4 standard errors of 1, the
    mean within 4, and no coordinate pair of two layers equal (independent draws)."""
    x, y = _toy_table(64)
    settings = TrainSettings(epochs=1, batch_size=64, lr=1.0, optimizer="sgd")
    sigma, clip = 1000.0, 1e-2
    torch.manual_seed(3)
    model = build_model("mlp", {"in_features": 15, "hidden": hidden})
    before = state_to_arrays(model)
    done = privacy.train_local_dp(model, x, y, settings, RecordDP(max_grad_norm=clip, noise_multiplier=sigma,
                                  engine="fused"), history=[], seed=5)
    assert done.engine == "fused" and done.stats.steps == 1
    after = state_to_arrays(model)
    z = np.concatenate([(after[k] - before[k]).astype(np.float64).ravel() for k in before])
    z /= settings.lr * sigma * clip / 64  # the expected batch: q = 1, 64 rows
    n = z.size
    assert n > 2000
    assert abs(z.std() - 1.0) < 4 / math.sqrt(2 * n)
    assert abs(z.mean()) < 4 / math.sqrt(n)
    assert abs(float(np.mean(np.abs(z))) - math.sqrt(2 / math.pi)) < 4 * 0.603 / math.sqrt(n)  # Gaussian, not flat
    first = before[next(iter(before))].size  # a lag of one parameter tensor: a draw repeated per tensor shows there
    for lag in (1, first):
        assert abs(float(np.corrcoef(z[:-lag], z[lag:])[0, 1])) < 4 / math.sqrt(n - lag)


def test_noise_differs_between_seeds_and_repeats_with_one() -> None:
    x, y = _toy_table(64)
    settings = TrainSettings(epochs=1, batch_size=16, lr=0.1, optimizer="sgd")
    dp = RecordDP(max_grad_norm=1.0, noise_multiplier=1.0, engine="fused")
    runs = []
    for seed in (1, 1, 2, None):
        torch.manual_seed(3)
        model = build_model("mlp", {"in_features": 15, "hidden": [32]})
        privacy.train_local_dp(model, x, y, settings, dp, history=[], seed=seed)
        runs.append(state_to_arrays(model))
    assert all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert any(not np.array_equal(runs[0][k], runs[2][k]) for k in runs[0])
    assert any(not np.array_equal(runs[0][k], runs[3][k]) for k in runs[0])


def test_an_empty_batch_steps_by_the_noise_alone() -> None:
    model = _model("mlp")
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    engine = fused_clipping.FusedDPSGD(model, _record_loss(BINARY), lambda ps: privacy._make_optimizer(
        ps, TrainSettings(optimizer="sgd", lr=1.0)), max_grad_norm=2.0, noise_multiplier=1.5, expected_batch_size=4,
        generator=torch.Generator().manual_seed(2))
    assert engine.step(torch.zeros(0, 15), torch.zeros(0)) == 0 and float(engine.loss_sum) == 0.0
    engine.write_back()
    noise = torch.empty_like(before).normal_(0.0, 3.0, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), before - noise / 4)


@pytest.mark.parametrize("engine", ["fused", "opacus", "torch.func"])
def test_no_labelled_record_takes_no_step_and_spends_nothing(engine: str) -> None:
    x, _ = _toy_table(4)
    model = _model("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    done = privacy.train_local_dp(model, x, np.full(4, np.nan, dtype=np.float32), TrainSettings(batch_size=8),
                                  RecordDP(max_grad_norm=1.0, noise_multiplier=1.0, engine=engine),
                                  history=[(1.0, 0.5, 3)], seed=1)
    assert done.stats.steps == 0 and done.stats.no_step_reason == "no labelled training row"
    assert done.history == [(1.0, 0.5, 3)] and done.epsilon == done.plan.epsilon_before > 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_batch_size_one_divides_by_one_record() -> None:
    """49 rows at batch size 1: q = 1/49, and 49 * (1/49) is just below 1 in floating point; the expected batch
    must still be one record, not zero."""
    x, y = _toy_table(49)
    model = _model("mlp")
    done = privacy.train_local_dp(model, x, y, TrainSettings(batch_size=1, steps_per_epoch=3, lr=0.01),
                                  RecordDP(max_grad_norm=1.0, noise_multiplier=1.0, engine="fused"), history=[], seed=3)
    assert done.stats.steps == 3
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_the_model_is_trained_in_place_and_gets_no_hooks() -> None:
    x, y = _toy_table(32)
    model = _model("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    privacy.train_local_dp(model, x, y, TrainSettings(batch_size=8), RecordDP(max_grad_norm=1.0, noise_multiplier=1.0,
                           engine="fused"), history=[], seed=1)
    assert model.training
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))  # trained in place
    assert not any(m._forward_hooks or m._backward_hooks or m._forward_pre_hooks for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_models_it_cannot_serve_are_refused_with_the_fix_and_auto_falls_back() -> None:
    gru = build_model("gru", {"n_features": 3, "hidden": 8})
    resnet = build_model("resnet1d_se", {"in_leads": 1, "base": 8, "blocks": [1], "norm": "gn"})
    same = nn.Sequential(nn.Conv1d(2, 4, 3, padding="same"), nn.Flatten(), nn.Linear(40, 1))
    frozen = _model("mlp")
    frozen.head.weight.requires_grad_(False)
    odd = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    # an in-place ReLU would overwrite the Linear output whose gradient the engine reads
    inplace = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    for model, says in [(gru, "GRUNet"), (resnet, "ResNet1dSE"), (same, "zero padding"), (frozen, "frozen"),
                        (odd, "BatchNorm1d"), (inplace, "inplace=False"), (nn.Sequential(nn.ReLU()), "none")]:
        why = fused_clipping.problem(model)
        assert why is not None and says in why and 'engine = "auto"' in why
        with pytest.raises(ValueError, match="fused"):
            privacy.choose_engine("fused", model, 8)
        assert privacy.choose_engine("auto", model, 8) != "fused"
    assert privacy.choose_engine("auto", gru, 8) == "opacus"


def test_auto_picks_the_fused_engine_for_the_zoos_mlp_and_lenet() -> None:
    for case in ALL:
        assert privacy.choose_engine("auto", _model(case), 64) == "fused"
    assert privacy.choose_engine("auto", _model("lenet-gn"), 4096) == "fused"  # it materialises no Linear gradient
    assert privacy.choose_engine("opacus", _model("mlp"), 64) == "opacus"
    assert privacy.choose_engine("torch.func", _model("mlp"), 64) == "torch.func"


def test_lenet_trains_to_a_lower_loss_with_the_fused_engine() -> None:
    """An end-to-end check that the steps go downhill: a learnable rule, moderate noise, several epochs."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 1, 12, 12)).astype(np.float32)
    y = (x[:, 0, :6].mean(axis=(1, 2)) > 0).astype(np.int64)
    x[:, 0, :6] += (2 * y - 1)[:, None, None] * 0.5
    torch.manual_seed(0)
    model = build_model("lenet5", {"n_classes": 2, "norm": "gn", "image_size": 12})
    task = TaskInfo("multiclass", 2)
    dp = RecordDP(max_grad_norm=1.0, noise_multiplier=0.5, engine="fused")
    first = privacy.train_local_dp(model, x, y, TrainSettings(batch_size=32, lr=0.5, optimizer="sgd"), dp,
                                   history=[], seed=1, task=task)
    later = privacy.train_local_dp(model, x, y, TrainSettings(epochs=4, batch_size=32, lr=0.5, optimizer="sgd"), dp,
                                   history=first.history, seed=2, task=task)
    assert first.stats.mean_loss is not None and later.stats.mean_loss is not None
    assert later.stats.mean_loss < first.stats.mean_loss - 0.1
    assert later.epsilon > first.epsilon and math.isfinite(later.epsilon)


def _toy_table(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 15)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.float32)
