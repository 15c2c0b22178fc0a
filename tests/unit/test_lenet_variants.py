"""lenet5's `pad_first` / `norm_dense` switches: the AdaFed authors' LeNet, and the zoo's default left unchanged.

The authors' LeNet (Chen et al.'s AdaFed reference code) for 1 x 28 x 28 images and 11 classes, written out:
conv 5x5 1->6 (no padding) -> BN2d(6) -> ReLU -> maxpool 2 -> conv 5x5 6->16 -> BN2d(16) -> ReLU -> maxpool 2
-> flatten (16 x 4 x 4 = 256) -> fc 256->120 -> ReLU -> fc 120->84 -> ReLU -> fc 84->11. No BN on dense layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from fedmqtt.errors import ConfigError  # noqa: E402
from fedmqtt.strategies.base import manifest_from_dict  # noqa: E402
from fedmqtt.strategies.registry import build_strategy  # noqa: E402
from fedmqtt.training.models import build_model, model_manifest  # noqa: E402
from fedmqtt.training.statistics import BN_INPUTS, bn_modules, site_statistics  # noqa: E402

AUTHORS: dict[str, Any] = {"n_classes": 11, "in_channels": 1, "norm": "bn", "pad_first": False, "norm_dense": False}
DEFAULT: dict[str, Any] = {"n_classes": 11, "in_channels": 1, "norm": "bn"}
AUTHORS_BN = ("features.1", "features.5")
DEFAULT_BN = ("features.1", "features.5", "classifier.2", "classifier.5")
# Parameters of the authors' LeNet, layer by layer (weights + biases; BN: weight + bias per channel).
AUTHORS_PARAMETERS = (
    (1 * 6 * 25 + 6) + 2 * 6 + (6 * 16 * 25 + 16) + 2 * 16 + (256 * 120 + 120) + (120 * 84 + 84) + (84 * 11 + 11)
)


def _reference(*, padding: int, fc_in: int, dense_bn: bool) -> nn.Sequential:
    """The architecture spelled out in layers, in the zoo's construction order (so one seed gives one init)."""
    def dense(width_in: int, width_out: int) -> list[nn.Module]:
        return [nn.Linear(width_in, width_out), *([nn.BatchNorm1d(width_out)] if dense_bn else []), nn.ReLU()]

    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=padding), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), *dense(fc_in, 120), *dense(120, 84), nn.Linear(84, 11),
    )


@pytest.mark.parametrize(
    ("args", "padding", "fc_in", "dense_bn"), [(AUTHORS, 0, 256, False), (DEFAULT, 2, 400, True)]
)
def test_lenet_matches_its_architecture_value_for_value(
    args: dict[str, Any], padding: int, fc_in: int, dense_bn: bool
) -> None:
    """Same seed, same initial values and same outputs as the written-out architecture: the authors' LeNet for
    the switches off, and the zoo's original model (pad 2, four BN layers) for the defaults, bit for bit."""
    torch.manual_seed(7)
    model = build_model("lenet5", args)
    torch.manual_seed(7)
    reference = _reference(padding=padding, fc_in=fc_in, dense_bn=dense_bn)
    ours, theirs = list(model.state_dict().values()), list(reference.state_dict().values())
    assert [t.shape for t in ours] == [t.shape for t in theirs]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    x = torch.randn(5, 1, 28, 28)
    for mode in (True, False):
        model.train(mode)
        reference.train(mode)
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_authors_lenet_has_their_parameter_count_and_fc1_width() -> None:
    """44,555 parameters for 1 x 28 x 28 and 11 classes; fc1 reads 256 features (the default: 400)."""
    model = build_model("lenet5", AUTHORS)
    assert AUTHORS_PARAMETERS == 44_555
    assert sum(p.numel() for p in model.parameters()) == AUTHORS_PARAMETERS
    assert model.classifier[1].in_features == 256
    assert build_model("lenet5", DEFAULT).classifier[1].in_features == 400
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 11)


@pytest.mark.parametrize(("args", "names"), [(AUTHORS, AUTHORS_BN), (DEFAULT, DEFAULT_BN)])
def test_local_batchnorm_is_exactly_the_models_bn_layers(args: dict[str, Any], names: tuple[str, ...]) -> None:
    """The manifest tags NORM on the BN layers' tensors only; FedBN and AdaFed keep exactly those local and
    f-AdaFed reads statistics at exactly those layers."""
    raw = model_manifest("lenet5", args)
    model = build_model("lenet5", args)
    assert list(raw) == list(model.state_dict())
    norm_keys = {k for k, spec in manifest_from_dict(raw).items() if spec.is_norm}
    leaves = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    assert norm_keys == {f"{layer}.{leaf}" for layer in names for leaf in leaves}
    assert all(raw[f"{layer}.running_mean"]["tags"] == ["FLOATBUF", "NORM:BatchNorm2d"] for layer in AUTHORS_BN)
    manifest = manifest_from_dict(raw)
    for strategy in (build_strategy("fedbn", {}), build_strategy("adafed", {"lam": 0.5})):
        assert set(strategy.shared_names(manifest)) == set(raw) - norm_keys
    assert tuple(bn_modules(model)) == names
    x = np.random.default_rng(0).normal(size=(4, 1, 28, 28)).astype(np.float32)
    assert tuple(site_statistics(BN_INPUTS, pretrained=model, trained=model, x_train=x)) == names


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"n_classes": 2, "pad_first": 0}, "pad_first"),
        ({"n_classes": 2, "norm_dense": "no"}, "norm_dense"),
        ({"n_classes": 2, "pad_first": False, "image_size": 15}, "image_size must be >= 16"),
    ],
)
def test_bad_switches_raise_config_error(args: dict[str, Any], match: str) -> None:
    """Switches must be booleans; without the padding the smallest image is 16 x 16."""
    with pytest.raises(ConfigError, match=match):
        build_model("lenet5", args)


def test_smallest_unpadded_image_builds() -> None:
    """16 x 16 without padding: 16 -> 12 -> 6 -> 2 -> 1, so fc1 reads 16 features."""
    model = build_model("lenet5", {"n_classes": 2, "pad_first": False, "image_size": 16})
    assert model.classifier[1].in_features == 16
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 2)
