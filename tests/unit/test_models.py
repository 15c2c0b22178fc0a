"""The model zoo: documented shapes, argument checks, manifest tags per norm, torchvision extra."""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedmqtt.errors import ConfigError  # noqa: E402
from fedmqtt.strategies.base import manifest_from_dict  # noqa: E402
from fedmqtt.strategies.rule import norm_family  # noqa: E402
from fedmqtt.training.models import MODELS, build_model, model_manifest  # noqa: E402
from fedmqtt.training.statistics import BN_INPUTS, PENULTIMATE, site_statistics  # noqa: E402
from fedmqtt.training.zoo.common import ChannelLayerNorm  # noqa: E402

# name -> (tiny args, input shape, output shape)
CASES: dict[str, tuple[dict[str, Any], tuple[int, ...], tuple[int, ...]]] = {
    "mlp": ({"in_features": 6, "hidden": [8]}, (5, 6), (5, 1)),
    "lenet5": ({"n_classes": 8}, (5, 1, 28, 28), (5, 8)),
    "gru": ({"n_features": 4, "hidden": 8, "static_features": 2, "n_outputs": 3}, (5, 7, 6), (5, 3)),
    "transformer": ({"n_features": 4, "d_model": 8, "heads": 2, "layers": 1}, (5, 7, 4), (5, 1)),
    "resnet1d_se": ({"n_outputs": 26, "base": 8, "blocks": [1, 1]}, (5, 12, 64), (5, 26)),
}
NORMS_OF = {name: ("none", "bn", "gn", "ln") for name in CASES} | {"transformer": ("ln", "bn", "gn")}
FAMILY = {"bn": "batchnorm", "gn": "groupnorm", "ln": "layernorm"}
PAIRS = [(name, norm) for name in CASES for norm in NORMS_OF[name]]


@pytest.mark.parametrize(("name", "norm"), PAIRS)
def test_forward_gives_documented_shape(name: str, norm: str) -> None:
    """Every model and norm maps the documented input shape to (n, outputs) in train and eval mode."""
    args, shape, out = CASES[name]
    model = build_model(name, {**args, "norm": norm})
    x = torch.randn(*shape)
    assert model(x).shape == out
    model.eval()
    with torch.inference_mode():
        assert model(x).shape == out
    assert isinstance(model.head, torch.nn.Linear)


@pytest.mark.parametrize(("name", "norm"), PAIRS)
def test_manifest_tags_every_tensor_by_module_type(name: str, norm: str) -> None:
    """NORM tags appear exactly for the chosen norm's family; buffers only with BN; `head` is HEAD."""
    args, _, _ = CASES[name]
    raw = model_manifest(name, {**args, "norm": norm})
    model = build_model(name, {**args, "norm": norm})
    assert list(raw) == list(model.state_dict())
    specs = manifest_from_dict(raw)
    families = {norm_family(s) for s in specs.values() if s.is_norm}
    assert families == (set() if norm == "none" else {FAMILY[norm]})
    for key, spec in specs.items():
        assert spec.is_head == key.startswith("head.")
        assert spec.is_train == (key in dict(model.named_parameters()))
        if spec.is_floatbuf or spec.is_intbuf:  # the only buffers are BN statistics
            assert norm == "bn" and norm_family(spec) == "batchnorm"
    if norm == "bn":
        assert any(s.is_intbuf and s.dtype == "int64" for s in specs.values())


def test_specific_manifest_entries() -> None:
    """Spot checks: the ECG stem's BN statistics, the transformer's BN inside a block, LeNet's channel LN."""
    ecg = model_manifest("resnet1d_se", {"base": 8, "blocks": [1], "norm": "bn"})
    stats = {"shape": [8], "dtype": "float32", "tags": ["FLOATBUF", "NORM:BatchNorm1d"]}
    assert ecg["stem.1.running_mean"] == stats
    assert ecg["stem.0.weight"]["tags"] == ["TRAIN"]
    seq = model_manifest("transformer", {"n_features": 3, "d_model": 8, "heads": 2, "norm": "bn"})
    assert seq["encoder.1.norm2.norm.weight"]["tags"] == ["TRAIN", "NORM:BatchNorm1d"]
    assert seq["encoder.0.attn.in_proj_weight"] == {"shape": [24, 8], "dtype": "float32", "tags": ["TRAIN"]}
    img = model_manifest("lenet5", {"n_classes": 2, "norm": "ln"})
    assert img["features.1.weight"]["tags"] == ["TRAIN", "NORM:ChannelLayerNorm"]
    assert img["head.weight"]["tags"] == ["TRAIN", "HEAD"]


def test_channel_layernorm_normalises_channels_at_each_position() -> None:
    """ChannelLayerNorm on (n, C, L) equals LayerNorm(C) on the (n, L, C) view."""
    x = torch.randn(3, 6, 5)
    layer, reference = ChannelLayerNorm(6), torch.nn.LayerNorm(6)
    torch.testing.assert_close(layer(x), reference(x.transpose(1, 2)).transpose(1, 2))


def test_gru_reads_static_features_from_the_first_step_only() -> None:
    """Static columns count at t=0 and are ignored later; the sequence part uses the first n_features."""
    model = build_model("gru", {"n_features": 3, "static_features": 2, "hidden": 4}).eval()
    x = torch.randn(2, 5, 5)
    base = model(x)
    later = x.clone()
    later[:, 1:, 3:] = 99.0
    torch.testing.assert_close(model(later), base)
    first = x.clone()
    first[:, 0, 3:] += 1.0
    assert not torch.allclose(model(first), base)
    with pytest.raises(ValueError, match=r"\(n, T, 5\)"):
        model(torch.randn(2, 5, 3))


def test_resnet1d_accepts_any_length_and_lenet_other_sizes() -> None:
    """Global pooling makes the ECG net length-agnostic; LeNet adapts its fc layer to `image_size`."""
    ecg = build_model("resnet1d_se", {"in_leads": 2, "base": 4, "blocks": [1, 1], "n_outputs": 3})
    assert ecg(torch.randn(2, 2, 37)).shape == ecg(torch.randn(2, 2, 100)).shape == (2, 3)
    lenet = build_model("lenet5", {"n_classes": 3, "in_channels": 3, "image_size": 32})
    assert lenet(torch.randn(2, 3, 32, 32)).shape == (2, 3)


@pytest.mark.parametrize(
    ("name", "args", "match"),
    [
        ("transformer", {"n_features": 3, "d_model": 10, "heads": 4}, "divisible"),
        ("transformer", {"n_features": 3, "norm": "none"}, "norm"),
        ("lenet5", {"n_classes": 2, "image_size": 10}, "image_size"),
        ("lenet5", {"n_classes": 0}, "n_classes"),
        ("resnet1d_se", {"blocks": []}, "blocks"),
        ("resnet1d_se", {"norm": "batch"}, "norm"),
        ("gru", {"n_features": 3, "dropout": 1.5}, "dropout"),
        ("gru", {"n_features": 3, "static_features": -1}, "static_features"),
        ("gru", {"n_features": True}, "n_features"),
        ("gru", {}, "missing"),
        ("gru", {"n_features": 2, "width": 3}, "width"),
    ],
)
def test_bad_arguments_raise_config_error(name: str, args: dict[str, Any], match: str) -> None:
    """Invalid or unknown arguments raise ConfigError naming the argument."""
    with pytest.raises(ConfigError, match=match):
        build_model(name, args)


def test_site_statistics_find_bn_inputs_and_head_input() -> None:
    """AdaFed reads each BN input per channel (axis 1) and d-AdaFed the input of `head`, for every model."""
    for name in CASES:
        args, shape, _ = CASES[name]
        model = build_model(name, {**args, "norm": "bn"})
        x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
        bn = site_statistics(BN_INPUTS, pretrained=model, trained=model, x_train=x)
        modules = dict(model.named_modules())
        assert bn and all(mean.shape == (modules[k].num_features,) for k, (mean, _) in bn.items())
        head = site_statistics(PENULTIMATE, pretrained=model, trained=model, x_train=x)
        assert head["head"][0].shape == (model.head.in_features,)


@pytest.mark.parametrize("name", ["densenet121", "efficientnet_b0", "alexnet"])
def test_vision_backbones_need_the_extra(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchvision the backbones raise ConfigError pointing to the [vision] extra."""
    monkeypatch.setitem(sys.modules, "torchvision", None)  # None makes the import fail even if installed
    monkeypatch.setitem(sys.modules, "torchvision.models", None)
    assert name in MODELS
    with pytest.raises(ConfigError, match=r"\[vision\] extra"):
        build_model(name, {"n_outputs": 2})


def _fake_densenet121(weights: Any = None) -> torch.nn.Module:
    assert weights is None
    net = torch.nn.Module()
    net.features = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                       torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    net.classifier = torch.nn.Linear(8, 1000)
    net.forward = lambda x: net.classifier(net.features(x))  # type: ignore[method-assign]
    return net


def _fake_efficientnet_b0(weights: Any = None) -> torch.nn.Module:
    del weights
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()
    )
    net.classifier = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(4, 1000))
    return net


def test_backbone_wrapping_with_a_stand_in_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The classifier's last Linear becomes `head`, BN is swapped for GN, the first conv takes 1 channel."""
    fake = types.ModuleType("torchvision.models")
    fake.densenet121 = _fake_densenet121  # type: ignore[attr-defined]
    fake.efficientnet_b0 = _fake_efficientnet_b0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    monkeypatch.setitem(sys.modules, "torchvision.models", fake)
    model = build_model("densenet121", {"n_outputs": 3, "in_channels": 1, "norm": "gn"})
    assert model(torch.randn(2, 1, 9, 9)).shape == (2, 3)
    assert model.head.in_features == 8 and isinstance(model.body.features[1], torch.nn.GroupNorm)
    tags = model_manifest("densenet121", {"n_outputs": 3, "in_channels": 1, "norm": "gn"})
    assert tags["head.weight"]["tags"] == ["TRAIN", "HEAD"]
    assert tags["body.features.1.weight"]["tags"] == ["TRAIN", "NORM:GroupNorm"]
    effnet = build_model("efficientnet_b0", {"n_outputs": 2, "norm": "ln", "dropout": 0.4})
    assert effnet.body.classifier[0].p == 0.4 and isinstance(effnet.body.classifier[1], torch.nn.Identity)
    assert isinstance(effnet.body[1], ChannelLayerNorm) and effnet.head.in_features == 4
