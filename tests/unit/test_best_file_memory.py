"""The best round's weights on disk: written from maps of an earlier checkpoint without reading them into the PS's
memory whole, and read back bit for bit as views of a map of the file (nothing copied)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ps_daemon.best_file import StoredWeights
from ps_daemon.checkpoint import CheckpointStore, open_maps, write_mapped
from ps_daemon.state import BestRound, DaemonState
from schemas.codec import pack_pieces
from schemas.tensors import arrays_to_blobs

MiB = 1 << 20


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _mapped_model(tmp_path: Path, mib: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the weights as written, the same weights as read-only maps of the file): what the PS holds between rounds."""
    rng = np.random.default_rng(0)
    arrays = {"big": rng.normal(size=mib * MiB // 4).astype(np.float32), "bias": rng.normal(size=7).astype(np.float32)}
    blobs = arrays_to_blobs(arrays)
    pieces = pack_pieces({"tensors": [b.model_dump() for b in blobs]})
    path, layout = write_mapped(tmp_path / "round-000001.ckpt", pieces, blobs)
    return {k: v.copy() for k, v in arrays.items()}, {**arrays, **open_maps(path, layout)}


def test_the_best_file_is_written_from_maps_without_reading_them_whole_and_read_back_exactly(tmp_path: Path) -> None:
    # Prepare: a 192 MiB model held as maps of its checkpoint, chosen as the best round
    expected, maps = _mapped_model(tmp_path, 192)
    assert isinstance(maps["big"], np.memmap)
    state = DaemonState(phase="training", round=2, weights={}, model_hash="h", best=BestRound(1, 0.5, maps, "h"))
    store = CheckpointStore(tmp_path / "checkpoints")
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current RSS
    before = _status_mib("VmRSS")

    # Execute
    spilled = store.spill_best(state)
    write_peak = _status_mib("VmHWM") - before
    stored = spilled.best.weights if spilled.best is not None else None
    assert isinstance(stored, StoredWeights)
    Path("/proc/self/clear_refs").write_text("5")
    before, anonymous = _status_mib("VmRSS"), _status_mib("RssAnon")
    loaded = stored.load()
    load_peak, load_anonymous = _status_mib("VmHWM") - before, _status_mib("RssAnon") - anonymous

    # Assert: written in blocks (the maps' pages dropped as it goes), not the whole 192 MiB; read back bit for
    # bit as read-only views of the mapped file (its pages, read by the hash check, are all it holds: no copy)
    assert write_peak < 64 + 40, f"writing the best file peaked {write_peak:.0f} MiB above the start"
    assert load_peak < 192 + 40 and load_anonymous < 16, (load_peak, load_anonymous)
    for name, array in expected.items():
        assert loaded[name].dtype == array.dtype and np.array_equal(loaded[name], array), name
    assert not loaded["big"].flags.writeable
