"""`fedmqtt pretrain`: a centrally trained model, written so that a run's `init_model` accepts it."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import load_file
from typer.testing import CliRunner

from fedmqtt.cli import app
from fedmqtt.training.models import model_manifest
from fedmqtt.training.weights import initial_arrays
from ps_daemon.init_model_file import load_init_model

ARGS = {"in_features": 15, "hidden": [8], "norm": "bn"}
CONFIG = """
run_id = "pre"
seed = 3
[model]
name = "mlp"
args = { in_features = 15, hidden = [8], norm = "bn" }
[train]
epochs = 1
batch_size = 64
lr = 0.01
"""


def test_pretrain_writes_a_trained_model_that_init_model_accepts(tmp_path) -> None:
    # Prepare
    (tmp_path / "sim.toml").write_text(CONFIG)
    out = tmp_path / "models" / "heart.safetensors"
    # Execute
    result = CliRunner().invoke(app, ["pretrain", str(tmp_path / "sim.toml"), "--out", str(out), "--epochs", "2"])
    # Assert
    assert result.exit_code == 0, result.output
    assert f"wrote {out}: 9 tensors of mlp, sha256 " in result.output
    assert out.stat().st_mode & 0o777 == 0o600 and [p.name for p in out.parent.iterdir()] == [out.name]  # atomic
    written, seeded = load_file(str(out)), initial_arrays("mlp", ARGS, 3)
    assert not np.array_equal(written["blocks.0.weight"], seeded["blocks.0.weight"])  # it trained
    assert written["blocks.1.num_batches_tracked"] > 0  # BatchNorm saw the pooled rows
    # Another federation's 4-class model takes the backbone and keeps its own head.
    other = {**ARGS, "out_features": 4}
    _, record = load_init_model(out, initial_arrays("mlp", other, 0), model_manifest("mlp", other),
                                tensors="matching")
    assert record.kept == ["head.weight", "head.bias"] and len(record.loaded) == 7


def test_pretrain_refuses_a_fraction_outside_zero_to_one(tmp_path) -> None:
    (tmp_path / "sim.toml").write_text(CONFIG)
    for bad in ("0", "1.5"):
        result = CliRunner().invoke(app, ["pretrain", str(tmp_path / "sim.toml"), "--out", str(tmp_path / "m"),
                                          "--fraction", bad])
        assert result.exit_code == 2 and not (tmp_path / "m").exists()
