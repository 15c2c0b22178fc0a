"""CheckpointStore: atomic per-round files, a faithful round trip, rotation, damage and mismatch handling."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedmqtt.errors import CheckpointError
from fedmqtt.strategies import FedAvg, SiteUpdate
from ps_daemon import effects as fx
from ps_daemon.checkpoint import (
    CheckpointStore,
    StoredWeights,
    best_weights,
    checkpoint_to_state,
    open_maps,
    state_to_checkpoint,
)
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SiteOnline, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights
from ps_daemon.state import DaemonState
from schemas.checkpoint import Checkpoint

SITES = ("site-a", "site-b")
RUN = "r1"


def _machine(**overrides: object) -> Machine:
    raw = {
        "run_id": RUN,
        "sites": list(SITES),
        "rounds": 3,
        "model": {"name": "mlp", "args": {}},
        "credentials": "creds.toml",
        **overrides,
    }
    return Machine(DaemonConfig.model_validate(raw), FedAvg(), hash_weights)


def _weights(value: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(int(value * 10))
    return {
        "fc.weight": (rng.normal(size=(3, 2)) + value).astype(np.float32),
        "fc.bias": np.array([value, -value], np.float32),
        "bn.num_batches_tracked": np.array(int(value * 10), np.int64),
    }


def _states_after_rounds(machine: Machine, rounds: int) -> list[DaemonState]:
    """The states of every SaveCheckpoint the machine asked for, round by round."""
    state = machine.initial_state(_weights(0.0))
    for site in SITES:
        state, _ = machine.step(state, SiteOnline(site, now=0.0))
    saved: list[DaemonState] = []
    aurocs = [{"site-a": 0.6, "site-b": None}, {"site-a": 0.9, "site-b": 0.7}, {"site-a": 0.1, "site-b": 0.2}]
    for r in range(rounds):
        for i, site in enumerate(SITES):
            update = SiteUpdate(site, _weights(r + 1 + i / 10), 10 + i, 4)
            event = UpdateReceived(
                site,
                float(r + 1),
                state.round,
                state.model_hash,
                update,
                train_loss=0.5 / (r + 1),
                val_metrics={"auroc": aurocs[r][site]},
            )
            state, effects = machine.step(state, event)
        saved.extend(e.state for e in effects if isinstance(e, fx.SaveCheckpoint))
    return saved


def _assert_weights_identical(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert got[name].tobytes() == array.tobytes(), name


def _checkpoint(machine: Machine, state: DaemonState) -> Checkpoint:
    return state_to_checkpoint(state, run_id=RUN, config_hash=machine.config.config_hash())


def test_save_load_round_trip_restores_the_state(tmp_path: Path) -> None:
    """Weights come back bit-identical; round, phase, selection, history and best round are preserved."""
    # Prepare
    machine = _machine()
    state = _states_after_rounds(machine, 2)[-1]
    store = CheckpointStore(tmp_path / "ckpt")
    # Execute
    path = store.save(_checkpoint(machine, state))
    restored = checkpoint_to_state(store.load_latest(run_id=RUN, config_hash=machine.config.config_hash()))
    # Assert
    assert path.name == "round-000003.ckpt"
    assert (restored.phase, restored.round, restored.model_hash) == ("training", 3, state.model_hash)
    _assert_weights_identical(restored.weights, state.weights)
    assert restored.model_hash == hash_weights(restored.weights)
    assert restored.selected == state.selected
    assert restored.accepted_rounds == state.accepted_rounds == {site: 2 for site in SITES}
    assert restored.history == state.history
    assert restored.history[0].per_site["site-b"]["auroc"] is None
    assert restored.strategy_state == state.strategy_state
    assert restored.best is not None and state.best is not None
    assert (restored.best.round, restored.best.score, restored.best.model_hash) == (
        state.best.round,
        state.best.score,
        state.best.model_hash,
    )
    _assert_weights_identical(restored.best.weights, state.best.weights)
    # A resumed state knows nobody online or offline yet and holds no updates
    assert restored.online == frozenset() and restored.offline == frozenset() and restored.updates == {}


def test_restored_weights_are_writable_copies(tmp_path: Path) -> None:
    """Weights loaded from a checkpoint are writable arrays, not views of the file's bytes."""
    machine = _machine()
    state = _states_after_rounds(machine, 1)[-1]
    store = CheckpointStore(tmp_path)
    store.save(_checkpoint(machine, state))
    restored = checkpoint_to_state(store.load_latest(run_id=RUN, config_hash=machine.config.config_hash()))
    assert all(array.flags.writeable for array in restored.weights.values())


def test_evaluating_state_round_trips(tmp_path: Path) -> None:
    """The checkpoint taken after the last round (phase evaluating) restores as evaluating."""
    machine = _machine(rounds=3)
    saved = _states_after_rounds(machine, 3)
    assert [s.phase for s in saved] == ["training", "training", "evaluating"]
    store = CheckpointStore(tmp_path)
    store.save(_checkpoint(machine, saved[-1]))
    restored = checkpoint_to_state(store.load_latest(run_id=RUN, config_hash=machine.config.config_hash()))
    assert restored.phase == "evaluating" and restored.round == 4
    assert len(restored.history) == 3


def test_keeps_only_the_newest_files(tmp_path: Path) -> None:
    """With keep=2 only the two newest round files remain after five saves."""
    # Prepare
    machine = _machine()
    base = _checkpoint(machine, _states_after_rounds(machine, 1)[-1])
    store = CheckpointStore(tmp_path, keep=2)
    # Execute
    for r in range(1, 6):
        store.save(base.model_copy(update={"round": r}))
    # Assert
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000004.ckpt", "round-000005.ckpt"]
    assert store.load_latest(run_id=RUN, config_hash=base.config_hash).round == 5


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "not-a-checkpoint"])
def test_damaged_newest_file_falls_back_to_the_previous(tmp_path: Path, damage: str) -> None:
    """A truncated or corrupted newest checkpoint is skipped in favour of the one before it."""
    # Prepare
    machine = _machine()
    states = _states_after_rounds(machine, 2)
    store = CheckpointStore(tmp_path)
    store.save(_checkpoint(machine, states[0]))
    newest = store.save(_checkpoint(machine, states[1]))
    data = newest.read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "garbage": b"\x00\xff" * 64,
        "empty": b"",
        "not-a-checkpoint": b"\x81\xa4kind\xa3xyz",  # msgpack {"kind": "xyz"}
    }[damage]
    newest.write_bytes(damaged)
    # Execute
    ckpt = store.load_latest(run_id=RUN, config_hash=machine.config.config_hash())
    # Assert
    assert ckpt.round == states[0].round == 2
    _assert_weights_identical(checkpoint_to_state(ckpt).weights, states[0].weights)


def test_only_damaged_files_is_an_error(tmp_path: Path) -> None:
    """If no file can be read, load_latest raises CheckpointError instead of starting over silently."""
    (tmp_path / "round-000001.ckpt").write_bytes(b"\xc1")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        CheckpointStore(tmp_path).load_latest(run_id=RUN, config_hash="x")


def test_different_config_hash_is_refused(tmp_path: Path) -> None:
    """A checkpoint written with another configuration is refused, naming both hashes."""
    machine = _machine()
    store = CheckpointStore(tmp_path)
    store.save(_checkpoint(machine, _states_after_rounds(machine, 1)[-1]))
    other = _machine(rounds=7).config.config_hash()
    assert other != machine.config.config_hash()
    with pytest.raises(CheckpointError, match="different configuration") as info:
        store.load_latest(run_id=RUN, config_hash=other)
    assert machine.config.config_hash() in str(info.value) and other in str(info.value)


def test_different_run_id_is_refused(tmp_path: Path) -> None:
    """A checkpoint of another run is refused, naming that run."""
    machine = _machine()
    store = CheckpointStore(tmp_path)
    store.save(_checkpoint(machine, _states_after_rounds(machine, 1)[-1]))
    with pytest.raises(CheckpointError, match="belongs to run 'r1', not 'r2'"):
        store.load_latest(run_id="r2", config_hash=machine.config.config_hash())


@pytest.mark.parametrize("exists", [True, False], ids=["empty-folder", "no-folder"])
def test_no_checkpoint_is_an_error(tmp_path: Path, exists: bool) -> None:
    """Nothing to resume from raises CheckpointError naming the folder."""
    folder = tmp_path / "ckpt"
    if exists:
        folder.mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in") as info:
        CheckpointStore(folder).load_latest(run_id=RUN, config_hash="x")
    assert str(folder) in str(info.value)


def test_save_leaves_no_temporary_file(tmp_path: Path) -> None:
    """After saves only `.ckpt` files remain: the temp file is renamed into place."""
    machine = _machine()
    store = CheckpointStore(tmp_path / "nested" / "ckpt")
    for state in _states_after_rounds(machine, 2):
        store.save(_checkpoint(machine, state))
    files = list((tmp_path / "nested" / "ckpt").iterdir())
    assert sorted(p.name for p in files) == ["round-000002.ckpt", "round-000003.ckpt"]
    assert not any(p.suffix == ".tmp" for p in files)


def _spill_and_save(store: CheckpointStore, machine: Machine, state: DaemonState) -> DaemonState:
    """What the PS does on every SaveCheckpoint effect."""
    state = store.spill_best(state)
    store.save(_checkpoint(machine, state))
    return state


def test_best_weights_live_in_one_file_that_checkpoints_name(tmp_path: Path) -> None:
    """The best round's weights are written once to their own file; checkpoints carry its name and hash only,
    and a resume reads them back bit-identical."""
    machine = _machine()
    states = _states_after_rounds(machine, 3)  # the best is round 2 from round 3 on (auroc 0.8)
    store = CheckpointStore(tmp_path)
    for state in states:
        spilled = _spill_and_save(store, machine, state)
    assert spilled.best is not None and states[-1].best is not None and spilled.best.round == 2
    assert isinstance(spilled.best.weights, StoredWeights)
    # round 1's file stays while the kept checkpoint of round 2 names it
    assert sorted(p.name for p in tmp_path.glob("best-round-*")) == ["best-round-000001.msgpack",
                                                                      "best-round-000002.msgpack"]
    ckpt = store.load_latest(run_id=RUN, config_hash=machine.config.config_hash())
    assert ckpt.best is not None and ckpt.best.file == "best-round-000002.msgpack" and ckpt.best.tensors == ()
    restored = checkpoint_to_state(ckpt, tmp_path)
    assert restored.best is not None
    _assert_weights_identical(best_weights(restored.best), dict(states[-1].best.weights))
    # The checkpoint file no longer holds the best model: about one model's bytes, not two
    model_bytes = sum(a.nbytes for a in states[-1].weights.values())
    assert store.latest().stat().st_size < 2 * model_bytes + 2000


def test_best_files_no_kept_checkpoint_names_are_removed(tmp_path: Path) -> None:
    """Rotation keeps the best files the kept checkpoints name, and only those."""
    machine = _machine()
    states = _states_after_rounds(machine, 3)  # best: round 1 at checkpoint 2, round 2 from checkpoint 3 on
    store = CheckpointStore(tmp_path, keep=2)
    _spill_and_save(store, machine, states[0])
    _spill_and_save(store, machine, states[1])
    assert sorted(p.name for p in tmp_path.glob("best-round-*")) == ["best-round-000001.msgpack",
                                                                      "best-round-000002.msgpack"]
    store.keep = 1
    _spill_and_save(store, machine, states[2])
    assert sorted(p.name for p in tmp_path.glob("best-round-*")) == ["best-round-000002.msgpack"]
    assert store.clear() == 1 and list(tmp_path.iterdir()) == []


def test_a_damaged_best_file_skips_its_checkpoint(tmp_path: Path) -> None:
    """A best file that does not match the hash its checkpoint recorded is found at resume, not at the run's
    end: that checkpoint is skipped like an unreadable one."""
    machine = _machine()
    states = _states_after_rounds(machine, 3)
    store = CheckpointStore(tmp_path)
    for state in states:
        _spill_and_save(store, machine, state)
    best_file = tmp_path / "best-round-000002.msgpack"
    damaged = bytearray(best_file.read_bytes())
    damaged[-1] ^= 0xFF
    best_file.write_bytes(bytes(damaged))
    ckpt = store.load_latest(run_id=RUN, config_hash=machine.config.config_hash())
    assert ckpt.round == 2  # checkpoints 4 and 3 name the damaged file; checkpoint 2 has round 1 as its best
    assert ckpt.best is not None and ckpt.best.file == "best-round-000001.msgpack"
    with pytest.raises(CheckpointError, match="missing or damaged"):
        StoredWeights(best_file, "0" * 64).load()


def test_a_checkpoint_naming_a_best_file_needs_its_folder(tmp_path: Path) -> None:
    machine = _machine()
    store = CheckpointStore(tmp_path)
    for state in _states_after_rounds(machine, 2):
        _spill_and_save(store, machine, state)
    with pytest.raises(CheckpointError, match="no folder"):
        checkpoint_to_state(store.load_latest(run_id=RUN, config_hash=machine.config.config_hash()))


def test_save_and_map_gives_read_only_maps_of_the_written_tensors(tmp_path: Path) -> None:
    """The large tensors come back as maps of the checkpoint file at the right offsets (the PS swaps them in for
    its arrays after publishing); small ones, packed inside the file's structure, are not mapped."""
    machine = _machine()
    state = _states_after_rounds(machine, 1)[-1]
    big = {**state.weights, "big.weight": np.arange(50_000, dtype=np.float32).reshape(100, 500)}
    state = replace(state, weights=big)
    store = CheckpointStore(tmp_path)
    path, layout = store.save_and_map(_checkpoint(machine, state))
    mapped = open_maps(path, layout)
    assert set(mapped) == {"big.weight"}
    view = mapped["big.weight"]
    assert isinstance(view, np.memmap) and not view.flags.writeable and Path(view.filename) == path.resolve()
    _assert_weights_identical({"big.weight": np.asarray(view)}, {"big.weight": big["big.weight"]})
    restored = checkpoint_to_state(store.load_latest(run_id=RUN, config_hash=machine.config.config_hash()), tmp_path)
    _assert_weights_identical(restored.weights, big)


def test_safetensors_files_are_mapped_exactly_or_not_at_all(tmp_path: Path) -> None:
    """The round-1 model (written by the init child process) is mapped, not loaded; a header that does not
    describe the file, or a tensor that cannot be mapped, means loading it instead (None)."""
    from safetensors.numpy import save_file

    from ps_daemon.checkpoint import safetensors_layout

    weights = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "n": np.array(7, np.int64)}
    save_file(weights, str(tmp_path / "w.safetensors"))
    maps = open_maps(tmp_path / "w.safetensors", safetensors_layout(tmp_path / "w.safetensors"))
    _assert_weights_identical({k: np.asarray(v) for k, v in maps.items()}, weights)
    assert not any(v.flags.writeable for v in maps.values())
    save_file({"e": np.zeros((0, 3), np.float32)}, str(tmp_path / "empty.safetensors"))
    assert safetensors_layout(tmp_path / "empty.safetensors") is None
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-4])  # the header promises more bytes than there are
    assert safetensors_layout(tmp_path / "cut.safetensors") is None
    (tmp_path / "huge.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + data[8:])
    assert safetensors_layout(tmp_path / "huge.safetensors") is None
