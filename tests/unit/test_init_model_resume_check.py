"""A PS resumed before round 1 closed (no checkpoint yet) loads `init_model` again: only the file the run's first
start loaded (its sha256 in out_dir/init_model.json) is accepted; another file, or no [init_model] any more, is
refused with both hashes and the fix. A fresh start records whatever file it loads."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from fedmqtt.errors import CheckpointError
from fedmqtt.training.weights import initial_arrays
from ps_daemon.config import DaemonConfig
from ps_daemon.init_model_file import InitModelError
from ps_daemon.model_init import INIT_RECORD_FILE, initial_model

ARGS = {"in_features": 15, "hidden": [16], "norm": "bn"}


def _write(path: Path, seed: int) -> str:
    save_file(initial_arrays("mlp", ARGS, seed), str(path))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _config(tmp_path: Path, path: Path | None) -> DaemonConfig:
    extra = {} if path is None else {"init_model": {"path": path}}
    return DaemonConfig(run_id="r1", sites=("a",), credentials=tmp_path / "c.toml", out_dir=tmp_path / "out",
                        model={"name": "mlp", "args": ARGS}, **extra)


def test_a_resume_loads_only_the_file_the_run_started_from(tmp_path) -> None:
    # Prepare: the first start loads a file and records its hash
    path = tmp_path / "init.safetensors"
    first_hash = _write(path, seed=7)
    started, _ = initial_model(_config(tmp_path, path))
    record = tmp_path / "out" / INIT_RECORD_FILE
    assert json.loads(record.read_text())["sha256"] == first_hash
    # Execute: another model's file at the same path
    swapped_hash = _write(path, seed=8)
    with pytest.raises(InitModelError) as refused:
        initial_model(_config(tmp_path, path), resume=True)
    # Assert: both hashes, where each was, and the fix; the record still names the first file
    text = str(refused.value)
    assert first_hash in text and swapped_hash in text and str(path) in text
    assert "without --resume" in text and "put the file it started from back" in text
    assert json.loads(record.read_text())["sha256"] == first_hash
    # ... the first file back, moved elsewhere (the path may change, the bytes may not): accepted, same model
    moved = tmp_path / "moved.safetensors"
    assert _write(moved, seed=7) == first_hash
    resumed, _ = initial_model(_config(tmp_path, moved), resume=True)
    assert resumed.keys() == started.keys()
    for name in started:
        np.testing.assert_array_equal(resumed[name], started[name], err_msg=name)


def test_a_resume_without_init_model_after_a_start_with_one_is_refused(tmp_path) -> None:
    path = tmp_path / "init.safetensors"
    first_hash = _write(path, seed=7)
    initial_model(_config(tmp_path, path))
    with pytest.raises(InitModelError, match=f"sha256 {first_hash}.*sets no \\[init_model\\] now"):
        initial_model(_config(tmp_path, None), resume=True)
    assert (tmp_path / "out" / INIT_RECORD_FILE).is_file()


def test_a_fresh_start_records_the_new_file_and_a_resume_then_holds_to_it(tmp_path) -> None:
    path = tmp_path / "init.safetensors"
    _write(path, seed=7)
    initial_model(_config(tmp_path, path))
    second = _write(path, seed=8)
    initial_model(_config(tmp_path, path))  # not a resume: the run starts over from this file
    assert json.loads((tmp_path / "out" / INIT_RECORD_FILE).read_text())["sha256"] == second
    initial_model(_config(tmp_path, path), resume=True)


@pytest.mark.parametrize("damaged", [b"", b"{not json", b'{"path": "x"}', b'{"path": "x", "sha256": "00"}',
                                     b"[]", b" " * (2 << 20)])
def test_a_damaged_record_stops_a_resume_with_the_fix(tmp_path, damaged: bytes) -> None:
    path = tmp_path / "init.safetensors"
    _write(path, seed=7)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / INIT_RECORD_FILE).write_bytes(damaged)
    with pytest.raises(CheckpointError, match="start the run afresh without --resume"):
        initial_model(_config(tmp_path, path), resume=True)
