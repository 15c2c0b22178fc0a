"""`fedmqtt simulate` with `init_model`: round 1 is the file's model (the head kept where it does not fit),
and the run report says which tensors were loaded and which kept."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from fedmqtt.errors import ConfigError
from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from fedmqtt.training.models import model_manifest
from fedmqtt.training.weights import initial_arrays
from ps_daemon.init_model_file import load_init_model
from ps_daemon.model_init import hash_weights

ARGS = {"in_features": 15, "hidden": [16], "norm": "bn"}
MODEL = {"name": "mlp", "args": ARGS}
TRAIN = {"epochs": 1, "batch_size": 64, "lr": 0.01}
SITES = ("cleveland", "switzerland")


def _config(tmp_path, init_model, algorithm="fedfbn") -> SimulationConfig:
    return SimulationConfig(run_id="init", algorithm=algorithm, rounds=1, seed=0, out_dir=tmp_path / "sim",
                            model=MODEL, train=TRAIN, init_model=init_model,
                            sites={s: d for s, d in bundled_sites().items() if s in SITES})


def test_round_one_is_the_pretrained_backbone_with_the_models_own_head(tmp_path) -> None:
    # Prepare: a backbone pretrained elsewhere, with a 3-class head
    pretrained = initial_arrays("mlp", {**ARGS, "out_features": 3}, 7)
    path = tmp_path / "blood.safetensors"
    save_file(pretrained, str(path))
    expected, _ = load_init_model(path, initial_arrays("mlp", ARGS, 0), model_manifest("mlp", ARGS),
                                  tensors="matching")
    # Execute
    report = run_simulation(_config(tmp_path, {"path": path, "tensors": "matching"}), progress=False)
    # Assert: the model the sites trained from in round 1 is exactly that one
    assert report["rounds"][0]["model_hash"] == hash_weights(expected)
    assert report["rounds"][0]["model_hash"] != hash_weights(initial_arrays("mlp", ARGS, 0))
    init = report["init_model"]
    assert init["kept"] == ["head.weight", "head.bias"] and "blocks.1.running_mean" in init["loaded"]
    assert json.loads((tmp_path / "sim" / "report.json").read_text())["init_model"] == init
    assert "## Starting model" in (tmp_path / "sim" / "report.md").read_text()


def test_without_init_model_the_report_says_none(tmp_path) -> None:
    report = run_simulation(_config(tmp_path, None, algorithm="fedavg"), progress=False)
    assert report["init_model"] is None
    assert report["rounds"][0]["model_hash"] == hash_weights(initial_arrays("mlp", ARGS, 0))


def test_a_bad_file_stops_the_run_before_round_one(tmp_path) -> None:
    path = tmp_path / "bad.safetensors"
    arrays = initial_arrays("mlp", ARGS, 7)
    arrays["blocks.0.weight"][0, 0] = np.nan
    save_file(arrays, str(path))
    with pytest.raises(ConfigError, match="tensor 'blocks.0.weight' holds NaN"):
        run_simulation(_config(tmp_path, {"path": path}), progress=False)


def test_adafeds_pretrained_file_is_checked_the_same_way(tmp_path) -> None:
    """AdaFed's `pretrained` model goes to every site: a file with a wrong shape is refused by name first."""
    path = tmp_path / "adafed.safetensors"
    save_file(initial_arrays("mlp", {**ARGS, "out_features": 3}, 7), str(path))
    config = _config(tmp_path, None, algorithm="adafed").model_copy(update={"pretrained": path})
    with pytest.raises(ConfigError, match=r"pretrained .*tensor 'head.bias': shape \[3\]"):
        run_simulation(config, progress=False)
