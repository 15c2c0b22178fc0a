"""The simulation's shortcuts (issue 30, goal 1) change no number: each is compared with the plain path it
replaces, which stays in the code.

- read once: inside `shared_datasets()` every site of a partition gets the pooled file's first read
  (fedmqtt.data.read_once); outside it each load reads the file itself.
- the best round's model is scored once when it is the final model (site_agent.agent.same_weights).
- no fsync during a simulation (fedmqtt.atomic.volatile_writes): files are still replaced atomically.
- the baselines score the data the agents loaded (fedmqtt.simulation.held_site_data), not a second load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fedmqtt.simulation as simulation
import site_agent.agent as agent_module
from fedmqtt.data.partitioners import PartitionSpec
from fedmqtt.data.read_once import shared_datasets
from fedmqtt.data.registry import load_dataset, load_site_data
from fedmqtt.data.spec import DataSpec
from fedmqtt.experiments.grid import PartitionAxis, partition_sites
from fedmqtt.simulation import SimulationConfig, run_simulation


def small_npz(path: Path, n: int = 240, classes: int = 4) -> Path:
    """A MedMNIST-shaped file: grey 28x28 images whose brightness carries the class (so training moves)."""
    rng = np.random.default_rng(7)
    arrays = {}
    for split, rows in (("train", n), ("val", n // 4), ("test", n // 4)):
        y = rng.integers(0, classes, size=(rows, 1))
        base = (y[:, :, None] * (200 // classes)).astype(np.int64)
        arrays[f"{split}_images"] = np.clip(base + rng.integers(0, 60, size=(rows, 28, 28)), 0, 255).astype(np.uint8)
        arrays[f"{split}_labels"] = y.astype(np.uint8)
    np.savez_compressed(path, **arrays)
    return path


def config(tmp_path: Path, out: str) -> SimulationConfig:
    axis = PartitionAxis(name="skew", spec=PartitionSpec(kind="label_skew", n_sites=4, alpha=0.5),
                         data=DataSpec(format="medmnist", path=small_npz(tmp_path / "pooled.npz")))
    return SimulationConfig.model_validate({
        "algorithm": "fedavg", "rounds": 3, "seed": 3, "selection_metric": "accuracy", "out_dir": tmp_path / out,
        "sites": partition_sites(axis, 0, tmp_path),
        "model": {"name": "lenet5", "args": {"n_classes": 4, "in_channels": 1, "norm": "bn"}},
        "train": {"epochs": 1, "batch_size": 16, "lr": 0.05, "optimizer": "sgd"}})


# What differs between two runs of the same config: clocks, resource use and where files went.
UNSTABLE = {"timings", "closed_at", "duration_s", "traffic", "usage", "compute_seconds", "seconds", "out_dir",
            "models", "config", "started_at", "finished_at"}


def outcome(cfg: SimulationConfig) -> tuple[str, Any]:
    """The final model's bytes (hashed) and the report without clocks and paths (model hashes, every round's
    and the final and best models' metrics per site stay)."""
    report = run_simulation(cfg, progress=False)
    digest = hashlib.sha256((cfg.out_dir / "final_model.safetensors").read_bytes()).hexdigest()
    return digest, _stable(json.loads(json.dumps(report, default=str).replace(str(cfg.out_dir), "OUT")))


def _stable(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _stable(v) for k, v in doc.items() if k not in UNSTABLE}
    if isinstance(doc, list):
        return [_stable(v) for v in doc]
    return doc


def test_fast_paths_give_the_plain_paths_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"same": 0}
    real_same = agent_module.same_weights

    def counting(a: Any, b: Any) -> bool:
        calls["same"] += 1
        return real_same(a, b)

    real_held = simulation.held_site_data
    held: list[int] = []

    def counting_held(cfg: SimulationConfig, agents: Any) -> Any:
        data = real_held(cfg, agents)
        held.append(len(data))
        return data

    monkeypatch.setattr(agent_module, "same_weights", counting)
    monkeypatch.setattr(simulation, "held_site_data", counting_held)
    fast = outcome(config(tmp_path, "fast"))
    assert calls["same"] == 4  # every site took the shortcut's test (and the metrics below show it was right)
    assert held == [4]  # the baselines loaded no site again
    # The plain paths: every load reads the file, the best model is always scored on its own, writes are fsynced,
    # the baselines load every site's data themselves.
    monkeypatch.setattr(simulation, "shared_datasets", contextlib.nullcontext)
    monkeypatch.setattr(simulation, "volatile_writes", contextlib.nullcontext)
    monkeypatch.setattr(agent_module, "same_weights", lambda a, b: False)
    monkeypatch.setattr(simulation, "held_site_data", lambda cfg, agents: {})
    plain = outcome(config(tmp_path, "plain"))
    assert fast[0] == plain[0]
    assert fast[1] == plain[1]
    assert fast[1]["final"]  # the comparison covered metrics, not two empty reports


def test_a_read_inside_the_block_is_the_read_outside_it_and_kept_read_only(tmp_path: Path) -> None:
    spec = DataSpec(format="medmnist", path=small_npz(tmp_path / "pooled.npz"))
    plain = load_dataset(spec)
    with shared_datasets():
        first, again = load_dataset(spec), load_dataset(spec)
        site = load_site_data(spec)
    assert first is again  # read once
    assert np.array_equal(first.x, plain.x) and np.array_equal(first.y, plain.y)
    assert np.array_equal(site.x_train, load_site_data(spec).x_train)
    with pytest.raises(ValueError, match="read-only"):
        first.x[0, 0, 0, 0] = 1.0
    assert load_dataset(spec) is not first  # outside the block nothing is kept


def test_a_rewritten_file_is_read_again(tmp_path: Path) -> None:
    path = small_npz(tmp_path / "pooled.npz")
    spec = DataSpec(format="medmnist", path=path)
    with shared_datasets():
        first = load_dataset(spec)
        small_npz(path, n=120)
        assert len(load_dataset(spec)) != len(first)


@pytest.mark.parametrize(("change", "same"), [(None, True), ("value", False), ("dtype", False), ("key", False),
                                              ("nan", False)])
def test_same_weights_is_bitwise(change: str | None, same: bool) -> None:
    a = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array(3, dtype=np.int64)}
    b = {k: v.copy() for k, v in a.items()}
    if change == "value":
        b["w"][0, 0] = np.nextafter(np.float32(0), np.float32(1))
    elif change == "dtype":
        b["w"] = b["w"].astype(np.float64)
    elif change == "key":
        b["x"] = b.pop("n")
    elif change == "nan":
        a["w"][0, 0] = b["w"][0, 0] = np.nan
    assert agent_module.same_weights(a, b) is same


def test_volatile_writes_skip_fsync_but_stay_atomic_and_private(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from fedmqtt.atomic import volatile_writes, write_atomic

    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    with volatile_writes():
        write_atomic(tmp_path / "a.bin", b"inside")
    assert synced == []
    assert (tmp_path / "a.bin").read_bytes() == b"inside" and not (tmp_path / "a.bin.tmp").exists()
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == 0o600
    write_atomic(tmp_path / "a.bin", b"outside")
    assert len(synced) == 2  # the file and its folder, as before
