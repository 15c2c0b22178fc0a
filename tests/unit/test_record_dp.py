"""Record-level DP-SGD at the site (fedmqtt.training.privacy): the accountant against an independent computation of
the sampled Gaussian's Renyi DP and against Opacus' PRV accountant; clipping and noise measured on real updates."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from fedmqtt.training import privacy  # noqa: E402
from fedmqtt.training.models import build_model  # noqa: E402
from fedmqtt.training.weights import state_to_arrays  # noqa: E402
from schemas.messages import RecordDP, TrainSettings  # noqa: E402


def _toy(n: int = 64, d: int = 15, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.float32)


def _mlp(norm: str = "none", hidden: list[int] | None = None) -> torch.nn.Module:
    torch.manual_seed(3)
    return build_model("mlp", {"in_features": 15, "hidden": hidden or [32], "norm": norm})


def _delta_norm(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(((after[k] - before[k]).astype(np.float64) ** 2).sum()) for k in before))


# -- the accountant ---------------------------------------------------------------------------------------
def _sgm_rdp(q: float, sigma: float, alpha: int) -> float:
    """Renyi DP of order `alpha` (an integer) of one step of the Poisson-sampled Gaussian mechanism, by the exact
    binomial expansion (Mironov, Talwar and Zhang, Renyi Differential Privacy of the Sampled Gaussian Mechanism):
    log sum_k C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 sigma^2)), over alpha - 1. Written here from the
    formula, independently of Opacus' code."""
    terms = [math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
             + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma**2) for k in range(alpha + 1)]
    top = max(terms)
    return (top + math.log(sum(math.exp(t - top) for t in terms))) / (alpha - 1)


def _epsilon_from_rdp(q: float, sigma: float, steps: int, delta: float) -> float:
    """(epsilon, delta) from RDP by the conversion of Balle et al. (Hypothesis testing interpretations and Renyi
    differential privacy), minimised over integer orders 2..256."""
    best = math.inf
    for alpha in range(2, 257):
        rdp = steps * _sgm_rdp(q, sigma, alpha)
        eps = rdp + math.log1p(-1 / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1)
        best = min(best, eps)
    return best


@pytest.mark.parametrize(("q", "sigma", "steps", "delta"), [
    (0.01, 1.1, 10_000, 1e-5),  # the MNIST-style setting of Abadi et al.: batch 600 of 60,000, 100 epochs
    (256 / 60_000, 1.1, 14_062, 1e-5),  # batch 256 of 60,000 for 60 epochs
    (0.1, 1.0, 30, 1e-5),
    (0.05, 2.0, 2_000, 1e-6),
])
def test_rdp_accountant_matches_an_independent_computation(q: float, sigma: float, steps: int, delta: float) -> None:
    """Opacus' RDP accountant minimises over fractional orders too, so it may be slightly tighter than integer
    orders alone, never looser."""
    ours = privacy.epsilon([(sigma, q, steps)], delta, "rdp")
    reference = _epsilon_from_rdp(q, sigma, steps, delta)
    assert ours <= reference + 1e-9
    assert ours == pytest.approx(reference, rel=0.03)


@pytest.mark.parametrize(("q", "sigma", "steps"), [(0.01, 1.1, 10_000), (0.1, 1.0, 30), (0.02, 0.8, 500)])
def test_prv_and_rdp_accountants_agree_within_tolerance(q: float, sigma: float, steps: int) -> None:
    """PRV accounting is (nearly) exact, RDP an upper bound: PRV's epsilon is at most RDP's, and close to it."""
    rdp = privacy.epsilon([(sigma, q, steps)], 1e-5, "rdp")
    prv = privacy.epsilon([(sigma, q, steps)], 1e-5, "prv")
    assert prv <= rdp * 1.01
    assert prv >= 0.6 * rdp


def test_epsilon_grows_with_steps_and_shrinks_with_noise() -> None:
    base = privacy.epsilon([(1.0, 0.1, 30)], 1e-5)
    assert privacy.epsilon([(1.0, 0.1, 60)], 1e-5) > base
    assert privacy.epsilon([(2.0, 0.1, 30)], 1e-5) < base
    assert privacy.epsilon([], 1e-5) == 0.0
    assert privacy.epsilon([(0.0, 0.1, 1)], 1e-5) == math.inf  # no noise: no guarantee at all


def test_history_composes_as_one_run() -> None:
    """Two rounds kept in the history cost what one run of both lengths costs."""
    split = privacy.epsilon([(1.0, 0.1, 30), (1.0, 0.1, 30)], 1e-5)
    assert split == pytest.approx(privacy.epsilon([(1.0, 0.1, 60)], 1e-5), rel=1e-9)


def test_target_epsilon_is_spent_over_the_planned_rounds() -> None:
    settings = TrainSettings(epochs=2, batch_size=16)
    dp = RecordDP(max_grad_norm=1.0, target_epsilon=2.0, planned_rounds=5)
    plan = privacy.plan_round(dp, 160, settings, [])
    assert plan.sample_rate == pytest.approx(0.1) and plan.steps == 20
    total = privacy.epsilon([(plan.noise_multiplier, plan.sample_rate, plan.steps * 5)], dp.delta)
    assert 1.9 <= total <= 2.0 + 1e-9
    assert plan.epsilon_after < total  # one round of five spends less than all five


# -- DP-SGD itself ----------------------------------------------------------------------------------------
def test_without_noise_the_update_is_bounded_by_clip_times_lr_times_steps() -> None:
    """q = 1 (one batch of every row): each step moves the weights by lr * (mean of clipped gradients), at most
    lr * C; the plain step on the same data moves them far more."""
    x, y = _toy(64)
    settings = TrainSettings(epochs=5, batch_size=64, lr=0.5, optimizer="sgd")
    clip = 1e-3
    model = _mlp()
    before = state_to_arrays(model)
    result = privacy.train_local_dp(model, x, y, settings, RecordDP(max_grad_norm=clip, noise_multiplier=0.0),
                                    history=[], seed=1)
    moved = _delta_norm(before, state_to_arrays(model))
    assert result.stats.steps == 5
    assert 0 < moved <= clip * settings.lr * result.stats.steps * (1 + 1e-5)
    plain = _mlp()
    from fedmqtt.training.loop import train_local

    train_local(plain, x, y, settings, seed=1)
    assert _delta_norm(before, state_to_arrays(plain)) > 50 * moved


def test_noise_has_the_configured_scale() -> None:
    """One step where the noise dwarfs the clipped sum (at most B * C = 0.64 in norm, against a noise of norm about
    sigma * C * sqrt(d) = 450): the update is about -lr * noise / B, whose coordinates have std lr * sigma * C / B
    (checked on thousands of coordinates, so within a few percent)."""
    x, y = _toy(64)
    settings = TrainSettings(epochs=1, batch_size=64, lr=1.0, optimizer="sgd")
    sigma, clip = 1000.0, 1e-2
    model = _mlp(hidden=[128])
    before = state_to_arrays(model)
    privacy.train_local_dp(model, x, y, settings, RecordDP(max_grad_norm=clip, noise_multiplier=sigma),
                           history=[], seed=5)
    after = state_to_arrays(model)
    moves = np.concatenate([(after[k] - before[k]).astype(np.float64).ravel() for k in before])
    expected = settings.lr * sigma * clip / 64
    assert moves.size > 2000
    assert np.std(moves) == pytest.approx(expected, rel=0.05)
    assert abs(np.mean(moves)) < 5 * expected / math.sqrt(moves.size)


def test_runs_with_other_seeds_differ_and_the_same_seed_repeats() -> None:
    x, y = _toy(64)
    settings = TrainSettings(epochs=1, batch_size=16, lr=0.1, optimizer="sgd")
    dp = RecordDP(max_grad_norm=1.0, noise_multiplier=1.0)
    runs = []
    for seed in (1, 1, 2):
        model = _mlp()
        privacy.train_local_dp(model, x, y, settings, dp, history=[], seed=seed)
        runs.append(state_to_arrays(model))
    assert all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert any(not np.array_equal(runs[0][k], runs[2][k]) for k in runs[0])


def test_unseeded_runs_draw_fresh_noise() -> None:
    """A site never seeds its noise from the run's seed (the PS knows it and could subtract the noise)."""
    x, y = _toy(64)
    settings = TrainSettings(epochs=1, batch_size=16, lr=0.1, optimizer="sgd", seed=7)
    dp = RecordDP(max_grad_norm=1.0, noise_multiplier=1.0)
    a, b = _mlp(), _mlp()
    privacy.train_local_dp(a, x, y, settings, dp, history=[])
    privacy.train_local_dp(b, x, y, settings, dp, history=[])
    assert any(not np.array_equal(v, state_to_arrays(b)[k]) for k, v in state_to_arrays(a).items())


def test_history_continues_across_rounds_and_the_plan_is_what_was_spent() -> None:
    x, y = _toy(80)
    settings = TrainSettings(epochs=2, batch_size=16, lr=0.05, optimizer="adam")
    dp = RecordDP(max_grad_norm=1.0, noise_multiplier=1.2)
    model = _mlp()
    first = privacy.train_local_dp(model, x, y, settings, dp, history=[], seed=1)
    second = privacy.train_local_dp(model, x, y, settings, dp, history=first.history, seed=2)
    assert first.epsilon == pytest.approx(first.plan.epsilon_after)
    assert second.plan.epsilon_before == pytest.approx(first.epsilon)
    assert second.epsilon == pytest.approx(second.plan.epsilon_after)
    assert second.epsilon > first.epsilon
    assert sum(n for _, _, n in second.history) == 2 * first.stats.steps == 20


def test_the_wrapped_model_leaves_no_hooks_behind() -> None:
    """The trainer reuses its model for evaluation and plain rounds: Opacus' per-sample hooks must not stick."""
    x, y = _toy(32)
    model = _mlp()
    privacy.train_local_dp(model, x, y, TrainSettings(batch_size=8), RecordDP(max_grad_norm=1.0, noise_multiplier=1.0),
                           history=[], seed=1)
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_batchnorm_is_refused_with_the_fix() -> None:
    problem = privacy.model_problem(_mlp(norm="bn"))
    assert problem is not None and 'norm = "gn"' in problem and "LayerNorm" in problem
    assert privacy.model_problem(_mlp(norm="gn")) is None
    assert privacy.model_problem(_mlp(norm="ln")) is None
    with pytest.raises(ValueError, match="GroupNorm"):
        x, y = _toy(32)
        privacy.train_local_dp(_mlp(norm="bn"), x, y, TrainSettings(), RecordDP(max_grad_norm=1.0,
                               noise_multiplier=1.0), history=[], seed=1)


def test_lenet_trains_with_dp() -> None:
    torch.manual_seed(0)
    model = build_model("lenet5", {"in_channels": 1, "image_size": 28, "n_classes": 3, "norm": "gn"})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 3, size=24)
    from fedmqtt.data.base import TaskInfo

    result = privacy.train_local_dp(model, x, y, TrainSettings(batch_size=8, optimizer="sgd", lr=0.1),
                                    RecordDP(max_grad_norm=1.0, noise_multiplier=1.0), history=[], seed=1,
                                    task=TaskInfo("multiclass", 3))
    assert result.stats.steps == 3 and math.isfinite(result.epsilon)


def test_algorithms_that_change_the_gradient_are_refused() -> None:
    assert privacy.settings_problem(TrainSettings(algorithm="fedprox")) is not None
    assert privacy.settings_problem(TrainSettings(algorithm="scaffold")) is not None
    assert privacy.settings_problem(TrainSettings(algorithm="fedavg", hyper={"feature_stats": 1})) is not None
    assert privacy.settings_problem(TrainSettings(algorithm="fedavg")) is None


def test_record_dp_needs_exactly_one_of_noise_and_target() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="exactly one"):
        RecordDP(max_grad_norm=1.0)
    with pytest.raises(ValidationError, match="exactly one"):
        RecordDP(max_grad_norm=1.0, noise_multiplier=1.0, target_epsilon=1.0)
    with pytest.raises(ValidationError):
        RecordDP(max_grad_norm=1.0, noise_multiplier=1.0, delta=1.0)


@pytest.mark.parametrize(("name", "y"), [
    ("bce", np.array([0.0, 1.0, 1.0, 0.0], np.float32)),
    ("ce", np.array([0, 2, 1, 2])),
    ("mse", np.array([0.5, -1.0, 2.0, 0.0], np.float32)),
    ("msle", np.array([0.5, 1.0, 2.0, 0.0], np.float32)),
])
def test_per_record_loss_means_to_the_plain_loss(name: str, y: np.ndarray) -> None:
    """Ghost clipping needs one loss per record: their mean is the loss plain training minimises."""
    from fedmqtt.training.loop import make_loss

    torch.manual_seed(0)
    out = torch.randn(4, 3 if name == "ce" else 1) - (0.5 if name == "msle" else 0.0)  # some msle outputs < 0
    target = torch.as_tensor(y)
    criterion = privacy.PerRecordLoss(name)
    assert float(criterion(out, target)) == pytest.approx(float(make_loss(name)(out, target)), rel=1e-6)
    criterion.reduction = "none"
    assert criterion(out, target).shape == (4,)


def test_privacy_spent_is_validated_on_the_wire() -> None:
    from pydantic import ValidationError

    from schemas.codec import decode, encode
    from schemas.messages import ClientUpdate, PrivacySpent

    spent = PrivacySpent(epsilon=1.5, delta=1e-5, noise_multiplier=1.0, sample_rate=0.1, steps=30)
    update = ClientUpdate(run_id="r", sender="a", round=1, base_model_hash="h", tensors=(), n_samples=1,
                          local_steps=1, privacy=spent)
    assert decode(encode(update)) == update
    for bad in ({"epsilon": -1.0}, {"epsilon": float("inf")}, {"delta": 0.0}, {"sample_rate": 1.5},
                {"steps": -1}, {"accountant": "moments"}, {"extra": 1}):
        with pytest.raises(ValidationError):
            PrivacySpent.model_validate({**spent.model_dump(), **bad})
