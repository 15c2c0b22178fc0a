"""Model registry, manifest, weight exchange, deterministic local training and evaluation."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedmqtt.data.heart_disease import bundled_path, load_site_file  # noqa: E402
from fedmqtt.data.splits import split_and_normalise  # noqa: E402
from fedmqtt.errors import ConfigError  # noqa: E402
from fedmqtt.training.client_rules import GradTerms  # noqa: E402
from fedmqtt.training.evaluate import evaluate_split, predict_scores  # noqa: E402
from fedmqtt.training.loop import derive_seed, train_local  # noqa: E402
from fedmqtt.training.models import build_model, gn_groups, tensor_manifest  # noqa: E402
from fedmqtt.training.weights import initial_arrays, load_arrays, state_to_arrays  # noqa: E402
from schemas.messages import TrainSettings  # noqa: E402


def _toy(n: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 15)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
    return x, y


def _fresh(norm: str = "none", dropout: float = 0.0, seed: int = 7) -> torch.nn.Module:
    model = build_model("mlp", {"in_features": 15, "norm": norm, "dropout": dropout})
    load_arrays(model, initial_arrays("mlp", {"in_features": 15, "norm": norm, "dropout": dropout}, seed))
    return model


def test_unknown_model_and_bad_args_raise_config_error() -> None:
    """Unknown names list the known models; unknown or invalid args name the argument."""
    with pytest.raises(ConfigError, match="known models: .*mlp"):
        build_model("resnet", {})
    with pytest.raises(ConfigError, match="width"):
        build_model("mlp", {"in_features": 15, "width": 3})
    with pytest.raises(ConfigError, match="in_features"):
        build_model("mlp", {})
    with pytest.raises(ConfigError, match="norm"):
        build_model("mlp", {"in_features": 15, "norm": "batch"})


@pytest.mark.parametrize("norm", ["none", "bn", "ln", "gn"])
def test_mlp_outputs_one_logit_per_row(norm: str) -> None:
    """Every norm variant maps (n, 15) to (n, 1) logits."""
    model = build_model("mlp", {"in_features": 15, "hidden": [16, 8], "norm": norm, "dropout": 0.1})
    assert model(torch.zeros(4, 15)).shape == (4, 1)
    assert gn_groups(32) == 8 and gn_groups(4) == 1


def test_manifest_tags_bn_mlp_by_module_type() -> None:
    """BN-MLP manifest: TRAIN for params, FLOATBUF running stats, INTBUF counter, NORM on all BN state."""
    manifest = tensor_manifest(build_model("mlp", {"in_features": 15, "norm": "bn"}))
    assert manifest["blocks.0.weight"] == {"shape": [32, 15], "dtype": "float32", "tags": ["TRAIN"]}
    assert manifest["blocks.1.weight"]["tags"] == ["TRAIN", "NORM:BatchNorm1d"]
    assert manifest["blocks.1.running_mean"]["tags"] == ["FLOATBUF", "NORM:BatchNorm1d"]
    assert manifest["blocks.1.running_var"]["tags"] == ["FLOATBUF", "NORM:BatchNorm1d"]
    counter = manifest["blocks.1.num_batches_tracked"]
    assert counter == {"shape": [], "dtype": "int64", "tags": ["INTBUF", "NORM:BatchNorm1d"]}
    assert manifest["head.bias"]["tags"] == ["TRAIN"]
    assert list(manifest) == list(build_model("mlp", {"in_features": 15, "norm": "bn"}).state_dict())


def test_manifest_ignores_misleading_names() -> None:
    """A Linear whose name contains 'bn' is not NORM; a LayerNorm named 'proj' is."""
    model = torch.nn.Sequential()
    model.add_module("bn_like", torch.nn.Linear(3, 3))
    model.add_module("proj", torch.nn.LayerNorm(3))
    manifest = tensor_manifest(model, head=["proj"])
    assert manifest["bn_like.weight"]["tags"] == ["TRAIN"]
    assert manifest["proj.weight"]["tags"] == ["TRAIN", "NORM:LayerNorm", "HEAD"]


def test_arrays_round_trip_and_strict_load() -> None:
    """state_to_arrays/load_arrays round-trip; a missing, extra or reshaped tensor is named in the error."""
    arrays = initial_arrays("mlp", {"in_features": 15, "norm": "bn"}, seed=1)
    assert list(arrays) == sorted(arrays)
    assert arrays["blocks.1.num_batches_tracked"].dtype == np.int64
    model = build_model("mlp", {"in_features": 15, "norm": "bn"})
    load_arrays(model, arrays)
    for key, value in state_to_arrays(model).items():
        np.testing.assert_array_equal(value, arrays[key])
    with pytest.raises(ValueError, match="head.bias"):
        load_arrays(model, {k: v for k, v in arrays.items() if k != "head.bias"})
    with pytest.raises(ValueError, match="extra"):
        load_arrays(model, {**arrays, "extra": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match="blocks.0.weight"):
        load_arrays(model, {**arrays, "blocks.0.weight": np.zeros((15, 32), np.float32)})


def test_initial_arrays_seeded_and_leave_global_rng_alone() -> None:
    """Same seed gives the same weights, a different seed differs, and the global RNG is untouched."""
    before = torch.get_rng_state()
    a = initial_arrays("mlp", {"in_features": 15}, seed=5)
    b = initial_arrays("mlp", {"in_features": 15}, seed=5)
    c = initial_arrays("mlp", {"in_features": 15}, seed=6)
    assert torch.equal(before, torch.get_rng_state())
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["head.weight"], c["head.weight"])


@pytest.mark.parametrize("norm", ["bn", "gn"])
def test_train_local_is_bit_identical(norm: str) -> None:
    """Two fresh copies trained on the same data and seed (dropout on) end bit-identical."""
    x, y = _toy(65)  # 65 rows with batch 16 leaves a trailing batch of 1 to drop
    settings = TrainSettings(epochs=2, batch_size=16, lr=1e-2, optimizer="adam")
    models = [_fresh(norm, dropout=0.2), _fresh(norm, dropout=0.2)]
    stats = [train_local(m, x, y, settings, seed=11) for m in models]
    assert stats[0].steps == stats[1].steps == 2 * 4
    assert stats[0].mean_loss == stats[1].mean_loss and stats[0].n_samples == 65
    a, b = (state_to_arrays(m) for m in models)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    other = _fresh(norm, dropout=0.2)
    train_local(other, x, y, settings, seed=12)
    assert not np.array_equal(state_to_arrays(other)["head.weight"], a["head.weight"])


def test_train_local_does_not_touch_global_rng() -> None:
    """Training with dropout leaves the caller's global torch RNG state as it was."""
    x, y = _toy()
    model = _fresh(dropout=0.5)  # building a model draws from the global RNG; do it before the snapshot
    before = torch.get_rng_state()
    train_local(model, x, y, TrainSettings(batch_size=8), seed=0)
    assert torch.equal(before, torch.get_rng_state())


def test_fedprox_term_pulls_towards_start() -> None:
    """A large mu keeps trainable weights closer to where the call started than mu = 0."""
    x, y = _toy()
    start = state_to_arrays(_fresh())
    drift = {}
    for mu in (0.0, 10.0):
        model = _fresh()
        settings = TrainSettings(epochs=3, batch_size=8, lr=0.05, optimizer="sgd")
        names = frozenset(name for name, _ in model.named_parameters())
        train_local(model, x, y, settings, seed=0, terms=GradTerms(prox_mu=mu, prox_names=names))
        end = state_to_arrays(model)
        drift[mu] = sum(float(((end[k] - start[k]) ** 2).sum()) for k in start)
    assert drift[10.0] < drift[0.0]


def test_derive_seed_is_stable() -> None:
    """derive_seed is a fixed function of (run seed, site, round), independent of PYTHONHASHSEED."""
    assert derive_seed(0, "va", 1) == 3126121948112715310
    assert derive_seed(0, "va", 2) != derive_seed(0, "va", 1) != derive_seed(0, "hungary", 1)
    assert 0 <= derive_seed(2**40, "x" * 100, 10**6) < 2**63


def test_predict_scores_restores_mode_and_handles_empty() -> None:
    """predict_scores gives probabilities in [0, 1], restores train mode, and returns () for no rows."""
    model = _fresh("bn")
    model.train()
    scores = predict_scores(model, _toy(10)[0], batch_size=3)
    assert scores.shape == (10,) and scores.dtype == np.float64
    assert ((scores >= 0) & (scores <= 1)).all() and model.training
    assert predict_scores(model, np.zeros((0, 15), np.float32)).shape == (0,)


def test_mlp_learns_cleveland() -> None:
    """An MLP trained on Cleveland's train split reaches test AUROC > 0.7."""
    x, y = load_site_file(bundled_path("cleveland"))
    data = split_and_normalise(x, y, seed=0)
    model = _fresh()
    settings = TrainSettings(epochs=10, batch_size=16, lr=1e-3, optimizer="adam")
    stats = train_local(model, data.x_train, data.y_train, settings, seed=0)
    assert stats.mean_loss is not None and stats.mean_loss < 0.7
    values, reasons = evaluate_split(model, data.x_test, data.y_test)
    assert reasons == {}
    assert values["auroc"] is not None and values["auroc"] > 0.7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU-resident path cannot run here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_train_local_on_the_gpu_by_any_name(device: str) -> None:
    """`device = "cuda"` (no index) keeps the split on the GPU and trains; it once crashed at the first batch
    because the data's `cuda:0` never equalled the configured `cuda`."""
    x, y = _toy(65)
    settings = TrainSettings(epochs=2, batch_size=16, lr=1e-2, optimizer="adam")
    stats = train_local(_fresh("bn"), x, y, settings, seed=11, device=device)
    assert stats.steps == 2 * 4 and stats.mean_loss is not None and np.isfinite(stats.mean_loss)
