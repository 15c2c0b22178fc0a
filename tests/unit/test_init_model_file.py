"""Round 1 from a pretrained file (`init_model`): what loads, what is kept, and every refusal by name."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from fedmqtt.training.models import model_manifest
from fedmqtt.training.weights import initial_arrays
from ps_daemon.config import DaemonConfig, InitModelConfig
from ps_daemon.init_model_file import InitModelError, load_init_model, size_limit

ARGS = {"in_features": 15, "hidden": [16], "norm": "bn"}
MANIFEST = model_manifest("mlp", ARGS)
SEEDED = initial_arrays("mlp", ARGS, 0)
PRETRAINED = initial_arrays("mlp", ARGS, 7)  # another seed: every tensor differs from SEEDED
OTHER_HEAD = initial_arrays("mlp", {**ARGS, "out_features": 3}, 7)  # the same backbone, a 3-class head


def _write(tmp_path: Path, arrays: dict[str, np.ndarray], name: str = "init.safetensors") -> Path:
    path = tmp_path / name
    save_file({k: np.require(v, requirements="C") for k, v in arrays.items()}, str(path))
    return path


def test_all_mode_loads_every_tensor_bit_for_bit(tmp_path) -> None:
    # Prepare
    path = _write(tmp_path, PRETRAINED)
    # Execute
    weights, record = load_init_model(path, SEEDED, MANIFEST, tensors="all")
    # Assert
    assert record.loaded == list(MANIFEST) and record.kept == [] and record.ignored == {}
    for name in MANIFEST:
        np.testing.assert_array_equal(weights[name], PRETRAINED[name], err_msg=name)
        assert weights[name].dtype == SEEDED[name].dtype and not weights[name].flags.writeable
    assert len(record.sha256) == 64


def test_matching_mode_keeps_the_models_own_head(tmp_path) -> None:
    """A head pretrained for 3 classes: the backbone loads, the 1-output head keeps its seeded values."""
    # Prepare
    path = _write(tmp_path, {**OTHER_HEAD, "optimizer.step": np.zeros(1, np.float32)})
    # Execute
    weights, record = load_init_model(path, SEEDED, MANIFEST, tensors="matching")
    # Assert
    assert record.kept == ["head.weight", "head.bias"]
    assert record.loaded == [n for n in MANIFEST if not n.startswith("head.")]
    assert record.ignored == {"head.bias": "shape [3], the model has [1]",
                              "head.weight": "shape [3, 16], the model has [1, 16]",
                              "optimizer.step": "not in the model"}
    for name in record.loaded:
        np.testing.assert_array_equal(weights[name], OTHER_HEAD[name])
    for name in record.kept:
        np.testing.assert_array_equal(weights[name], SEEDED[name])


@pytest.mark.parametrize(("change", "named", "why"), [
    (lambda a: {**a, "head.weight": np.zeros((3, 16), np.float32)}, "head.weight", "shape [3, 16]"),
    (lambda a: {**a, "head.bias": a["head.bias"].astype(np.float64)}, "head.bias", "dtype float64"),
    (lambda a: {**a, "extra": np.zeros(2, np.float32)}, "extra", "not in the model"),
    (lambda a: {k: v for k, v in a.items() if k != "blocks.1.running_var"}, "blocks.1.running_var", "missing"),
])
def test_all_mode_refuses_any_difference_by_name(tmp_path, change, named, why) -> None:
    path = _write(tmp_path, change(dict(PRETRAINED)))
    with pytest.raises(InitModelError, match=rf"tensor '{named}'.*{re.escape(why)}"):
        load_init_model(path, SEEDED, MANIFEST, tensors="all")


@pytest.mark.parametrize("tensors", ["all", "matching"])
@pytest.mark.parametrize(("name", "value", "why"), [
    ("blocks.0.weight", np.nan, "NaN or infinity"), ("head.bias", np.inf, "NaN or infinity"),
    ("blocks.1.running_var", -1.0, "negative"), ("blocks.1.num_batches_tracked", -3, "negative"),
])
def test_bad_values_are_refused_in_both_modes(tmp_path, tensors, name, value, why) -> None:
    # Prepare
    arrays = {k: np.array(v, copy=True) for k, v in PRETRAINED.items()}
    arrays[name].reshape(-1)[0] = value
    path = _write(tmp_path, arrays)
    # Execute / Assert
    with pytest.raises(InitModelError, match=rf"tensor '{name}' holds .*{why}"):
        load_init_model(path, SEEDED, MANIFEST, tensors=tensors)


def test_a_file_with_nothing_that_fits_is_refused(tmp_path) -> None:
    path = _write(tmp_path, {"conv.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(InitModelError, match="no tensor has the model's name, dtype and shape"):
        load_init_model(path, SEEDED, MANIFEST, tensors="matching")


def test_size_is_checked_before_the_file_is_opened(tmp_path) -> None:
    # Prepare: not even a safetensors file; only its size is looked at
    path = tmp_path / "huge.safetensors"
    path.write_bytes(b"\0" * (size_limit(MANIFEST, None) + 1))
    # Execute / Assert
    with pytest.raises(InitModelError, match="bytes, more than the"):
        load_init_model(path, SEEDED, MANIFEST)
    with pytest.raises(InitModelError, match="more than the 100 this model allows"):
        load_init_model(_write(tmp_path, PRETRAINED), SEEDED, MANIFEST, max_bytes=100)


def test_a_missing_file_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(InitModelError, match="nowhere.safetensors: cannot read it"):
        load_init_model(tmp_path / "nowhere.safetensors", SEEDED, MANIFEST)


VALID = None


def _valid_bytes(tmp_path_factory) -> bytes:
    global VALID
    if VALID is None:
        VALID = _write(tmp_path_factory.mktemp("valid"), PRETRAINED).read_bytes()
    return VALID


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_bytes_are_refused_or_loaded_never_crash(tmp_path_factory, data) -> None:
    """Random bytes, a valid file cut anywhere or with bytes flipped: an InitModelError or a checked load."""
    valid = _valid_bytes(tmp_path_factory)
    kind = data.draw(st.sampled_from(["random", "truncated", "flipped"]))
    if kind == "random":
        raw = data.draw(st.binary(max_size=2048))
    elif kind == "truncated":
        raw = valid[:data.draw(st.integers(0, len(valid) - 1))]
    else:
        at = data.draw(st.lists(st.integers(0, len(valid) - 1), min_size=1, max_size=8))
        buf = bytearray(valid)
        for i in at:
            buf[i] ^= data.draw(st.integers(1, 255))
        raw = bytes(buf)
    path = tmp_path_factory.mktemp("hostile") / "x.safetensors"
    path.write_bytes(raw)
    tensors = data.draw(st.sampled_from(["all", "matching"]))
    try:
        weights, record = load_init_model(path, SEEDED, MANIFEST, tensors=tensors)
    except InitModelError as exc:
        assert str(path) in str(exc)
        return
    for name, spec in MANIFEST.items():  # what loads fits the manifest and is finite
        assert list(weights[name].shape) == spec["shape"] and str(weights[name].dtype) == spec["dtype"]
        assert np.isfinite(weights[name]).all()
    assert record.loaded


def _daemon(tmp_path: Path, **extra) -> DaemonConfig:
    return DaemonConfig(run_id="r1", sites=("a",), credentials=tmp_path / "c.toml", out_dir=tmp_path / "out",
                        model={"name": "mlp", "args": ARGS}, **extra)


def test_config_hash_unchanged_without_init_model_and_follows_the_mode(tmp_path) -> None:
    plain = _daemon(tmp_path)
    all_mode = _daemon(tmp_path, init_model={"path": tmp_path / "a.safetensors"})
    moved = _daemon(tmp_path, init_model={"path": tmp_path / "elsewhere" / "a.safetensors"})
    matching = _daemon(tmp_path, init_model={"path": tmp_path / "a.safetensors", "tensors": "matching"})
    assert all_mode.config_hash() == moved.config_hash() != plain.config_hash()
    assert matching.config_hash() != all_mode.config_hash()
    assert "init_model" not in plain.model_dump(mode="json", exclude_none=True)


def test_relative_init_model_resolves_against_the_config_folder(tmp_path) -> None:
    assert InitModelConfig(path=Path("m.safetensors")).resolved(tmp_path).path == tmp_path / "m.safetensors"
    with pytest.raises(ValueError, match="tensors"):
        InitModelConfig(path=Path("m.safetensors"), tensors="some")  # type: ignore[arg-type]


_DTYPES = (np.float32, np.float64, np.float16, np.int64, np.int32)


@st.composite
def _checkpoints(draw) -> dict[str, np.ndarray]:
    """Files a stranger might offer: some of the model's names with the right or a wrong dtype or shape,
    and names the model lacks; values finite and non-negative, so only the fit decides."""
    out: dict[str, np.ndarray] = {}
    for name in draw(st.lists(st.sampled_from([*MANIFEST, "head2.weight", "conv.bias"]), unique=True)):
        spec = MANIFEST.get(name, {"shape": [2], "dtype": "float32"})
        shape = tuple(spec["shape"]) if draw(st.booleans()) else tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
        dtype = np.dtype(spec["dtype"]) if draw(st.booleans()) else np.dtype(draw(st.sampled_from(_DTYPES)))
        out[name] = np.full(shape, draw(st.integers(0, 3)), dtype=dtype)
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrays=_checkpoints())
def test_matching_loads_exactly_what_fits_and_accounts_for_everything(tmp_path_factory, arrays) -> None:
    # Prepare
    path = tmp_path_factory.mktemp("fit") / "m.safetensors"
    save_file(arrays, str(path))
    fits = [n for n in MANIFEST if n in arrays and str(arrays[n].dtype) == MANIFEST[n]["dtype"]
            and list(arrays[n].shape) == MANIFEST[n]["shape"]]
    # Execute
    try:
        weights, record = load_init_model(path, SEEDED, MANIFEST, tensors="matching")
    except InitModelError as exc:
        # Assert: refused only when nothing fits
        assert not fits and "no tensor has the model's name" in str(exc)
        return
    # Assert: loaded = what fits, kept = the rest of the model, ignored = the rest of the file
    assert record.loaded == fits and record.kept == [n for n in MANIFEST if n not in fits]
    assert set(record.ignored) == set(arrays) - set(fits)
    for name in fits:
        np.testing.assert_array_equal(weights[name], arrays[name])
    for name in record.kept:
        assert weights[name] is SEEDED[name]
