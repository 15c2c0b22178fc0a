"""Durable checkpoints: one file per round, written atomically (temp file, fsync, os.replace).

The best round's weights (Hwang et al.'s protocol) live in a file of their own, `best-round-<r>.msgpack`, written
once when round r becomes the best; checkpoints name it and its SHA-256. That keeps a second model out of the
PS's memory for the rest of the run and out of every later checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from fedmqtt.atomic import private_dir, write_atomic
from fedmqtt.errors import CheckpointError, SchemaError
from fedmqtt.strategies.aggregate import release_pages
from fedmqtt.strategies.base import Manifest, manifest_from_dict
from ps_daemon.best_file import StoredWeights
from ps_daemon.state import BestRound, CheckpointPhase, DaemonState, Phase, RoundRecord
from schemas.checkpoint import BEST_FILE_PATTERN, BestRoundRecord, Checkpoint
from schemas.codec import decode_checkpoint, encode_checkpoint, pack_pieces
from schemas.tensors import TensorBlob, arrays_to_blobs, blobs_to_arrays

log = logging.getLogger(__name__)
_WRITE_BLOCK = 64 * 2**20  # bytes written between two drops of the pages read (spill_best)


def _pack(value: Any) -> Any:
    """Strategy state to msgpack-friendly values: arrays become tagged tensor blobs (no pickle)."""
    if isinstance(value, np.ndarray):
        return {"__tensor__": TensorBlob.from_numpy("state", np.asarray(value)).model_dump()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _pack(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_pack(v) for v in value]
    return value


def _unpack(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return TensorBlob.model_validate(value["__tensor__"]).to_numpy().copy()
        return {k: _unpack(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unpack(v) for v in value]
    return value


def _manifest_to_dict(manifest: Manifest) -> dict[str, dict[str, Any]]:
    return {n: {"shape": list(t.shape), "dtype": t.dtype, "tags": sorted(t.tags)} for n, t in manifest.items()}


def best_weights(best: BestRound) -> dict[str, np.ndarray]:
    """The best round's weights, from memory or from its file."""
    return best.weights.load() if isinstance(best.weights, StoredWeights) else dict(best.weights)


def checkpoint_phase(phase: Phase) -> CheckpointPhase:
    """The phase as a checkpoint may hold it: only a run in a round or in its final evaluation is checkpointed.

    Before round 1 there is nothing to resume (a resume finds no checkpoint and starts from the config), and a
    finished run is never resumed; a checkpoint of either could not be read back as a `Checkpoint`.
    """
    if phase == "training" or phase == "evaluating":
        return phase
    raise CheckpointError(f"a PS in phase {phase!r} has nothing to checkpoint (only training or evaluating)")


def state_to_checkpoint(state: DaemonState, *, run_id: str, config_hash: str) -> Checkpoint:
    """The checkpoint of `state`; CheckpointError for a state outside training and the final evaluation."""
    phase = checkpoint_phase(state.phase)
    best = None
    if state.best is not None:
        b = state.best
        best = BestRoundRecord(round=b.round, score=b.score, model_hash=b.model_hash, file=b.weights.path.name,
                               sha256=b.weights.sha256) if isinstance(b.weights, StoredWeights) else BestRoundRecord(
            round=b.round, score=b.score, model_hash=b.model_hash, tensors=arrays_to_blobs(b.weights))
    return Checkpoint(
        run_id=run_id, config_hash=config_hash, phase=phase, round=state.round,
        model_hash=state.model_hash, tensors=arrays_to_blobs(state.weights), selected=state.selected,
        accepted_rounds=dict(state.accepted_rounds),
        history=tuple(dataclasses.asdict(r) for r in state.history), best=best,
        strategy_state=_pack(dict(state.strategy_state)), manifest=_manifest_to_dict(state.manifest),
        enrolled=dict(state.enrolled), personal={k: arrays_to_blobs(v) for k, v in state.personal.items()},
        extras={k: arrays_to_blobs(v) for k, v in state.extras.items()}, saved_at=time.time(),
        recruited=state.recruited, recruitment=None if state.recruitment is None else dict(state.recruitment),
        session=state.session,
    )


def checkpoint_to_state(ckpt: Checkpoint, folder: Path | None = None) -> DaemonState:
    """The state a checkpoint holds; `folder` is where it lies (needed when its best weights are in a file)."""
    history = tuple(
        RoundRecord(**{**h, "sites": tuple(h["sites"]), "stragglers": tuple(h["stragglers"])}) for h in ckpt.history
    )
    best = None
    if ckpt.best is not None and ckpt.best.file:
        if folder is None:
            raise CheckpointError(f"the checkpoint's best weights are in {ckpt.best.file}, but no folder was given")
        stored = StoredWeights(Path(folder) / ckpt.best.file, ckpt.best.sha256)
        best = BestRound(ckpt.best.round, ckpt.best.score, stored, ckpt.best.model_hash)
    elif ckpt.best is not None:
        weights = _copy(blobs_to_arrays(ckpt.best.tensors))
        best = BestRound(ckpt.best.round, ckpt.best.score, weights, ckpt.best.model_hash)
    return DaemonState(
        phase=ckpt.phase, round=ckpt.round, weights=_copy(blobs_to_arrays(ckpt.tensors)), model_hash=ckpt.model_hash,
        selected=ckpt.selected, accepted_rounds=dict(ckpt.accepted_rounds), history=history, best=best,
        strategy_state=_unpack(dict(ckpt.strategy_state)), manifest=manifest_from_dict(ckpt.manifest),
        enrolled=dict(ckpt.enrolled), personal={k: _copy(blobs_to_arrays(v)) for k, v in ckpt.personal.items()},
        extras={k: _copy(blobs_to_arrays(v)) for k, v in ckpt.extras.items()},
        recruited=ckpt.recruited, recruitment=ckpt.recruitment, session=ckpt.session,
    )


def _copy(arrays: dict) -> dict:
    return {k: v.copy() for k, v in arrays.items()}  # writable arrays, detached from the file bytes


class CheckpointStore:
    """Checkpoint files `round-000012.ckpt` in one folder; keeps the newest `keep`."""

    def __init__(self, folder: Path, *, keep: int = 3) -> None:
        self.folder = Path(folder)
        self.keep = keep

    def save(self, ckpt: Checkpoint) -> Path:
        return self.save_and_map(ckpt)[0]

    def save_and_map(self, ckpt: Checkpoint) -> tuple[Path, Layout]:
        """Write `ckpt`; also say where its large model tensors lie in the file (see `open_maps`).

        Why: between rounds the PS needs the current model only for its layout until the next aggregation,
        and a map whose pages were never read is not in the PS's memory. The runner swaps maps in for the
        arrays once the model is published (a map outlives the file's later rotation; Linux keeps it)."""
        private_dir(self.folder)
        path, layout = write_mapped(self.folder / f"round-{ckpt.round:06d}.ckpt", encode_checkpoint(ckpt),
                                    ckpt.tensors)
        for old in self._files()[: -self.keep]:
            old.unlink(missing_ok=True)
        self._drop_unreferenced_best_files()
        return path, layout

    def spill_best(self, state: DaemonState) -> DaemonState:
        """`state` with its best weights moved to their own file (written once per best round; durable before
        any checkpoint names it). The arrays are then free unless the current model still uses them."""
        best = state.best
        if best is None or isinstance(best.weights, StoredWeights):
            return state
        private_dir(self.folder)
        # Not checked again (the PS made these weights and checked them when it did): the finiteness scan, in
        # the blobs and again in the record, would read the maps whole before a byte is written.
        record = BestRoundRecord.model_construct(round=best.round, score=best.score, model_hash=best.model_hash,
                                                 tensors=arrays_to_blobs(best.weights, check=False))
        digest, weights = hashlib.sha256(), best.weights

        def blocks() -> Iterator[memoryview]:
            """The file's bytes in blocks, hashed as they go; the pages of maps read for each are dropped once it
            is written: the weights are usually maps of an earlier checkpoint, and read whole they would sit in
            the PS's memory beside the new model it has just aggregated."""
            unreleased = 0
            for piece in pack_pieces(record.model_dump(mode="python")):
                view = memoryview(piece)
                for start in range(0, len(view), _WRITE_BLOCK):
                    block = view[start:start + _WRITE_BLOCK]
                    digest.update(block)
                    yield block
                    unreleased += len(block)
                    if unreleased >= _WRITE_BLOCK:
                        drop_read_pages(weights)
                        unreleased = 0
            drop_read_pages(weights)

        path = write_atomic(self.folder / f"best-round-{best.round:06d}.msgpack", blocks())
        return replace(state, best=replace(best, weights=StoredWeights(path, digest.hexdigest())))

    def _drop_unreferenced_best_files(self) -> None:
        """Best-round files that no kept checkpoint names (a run keeps only the newest `keep` checkpoints)."""
        named = {_best_file_named_by(path) for path in self._files()}
        for path in self.folder.glob("best-round-*.msgpack"):
            if path.name not in named:
                path.unlink(missing_ok=True)

    def latest(self) -> Path | None:
        """The newest checkpoint file, if any."""
        files = self._files()
        return files[-1] if files else None

    def clear(self) -> int:
        """Remove every checkpoint (a forced fresh start); returns how many there were."""
        files = self._files()
        for path in [*files, *self.folder.glob("best-round-*.msgpack")]:
            path.unlink(missing_ok=True)
        return len(files)

    def _files(self) -> list[Path]:
        return sorted(self.folder.glob("round-*.ckpt")) if self.folder.is_dir() else []

    def load_latest(self, *, run_id: str, config_hash: str) -> Checkpoint:
        """The newest readable checkpoint; refuse one written by another run or configuration."""
        files = self._files()
        if not files:
            raise CheckpointError(f"no checkpoint in {self.folder}: nothing to resume (start without --resume)")
        for path in reversed(files):
            try:
                ckpt = decode_checkpoint(path.read_bytes())
            except SchemaError as exc:
                log.warning("skipping unreadable checkpoint %s: %s", path, exc)
                continue
            if ckpt.run_id != run_id:
                raise CheckpointError(f"{path} belongs to run {ckpt.run_id!r}, not {run_id!r}")
            if ckpt.config_hash != config_hash:
                raise CheckpointError(
                    f"{path} was written with a different configuration (hash {ckpt.config_hash} != {config_hash}); "
                    "resuming would mix two experiments"
                )
            if ckpt.best is not None and ckpt.best.file:
                try:  # found now, not when the run ends and the best model is written
                    StoredWeights(self.folder / ckpt.best.file, ckpt.best.sha256).load()
                except CheckpointError as exc:
                    log.warning("skipping checkpoint %s: %s", path, exc)
                    continue
            return ckpt
        raise CheckpointError(f"no readable checkpoint in {self.folder}")


Layout = dict[str, tuple[int, str, tuple[int, ...]]]  # tensor name -> (file offset, dtype, shape)


def write_mapped(path: Path, pieces: list[bytes | memoryview], blobs: tuple[TensorBlob, ...]) -> tuple[Path, Layout]:
    """Write `pieces` (from `pack_pieces`) atomically and durably; return where in the file each of `blobs` that
    is a piece of its own (the large ones) lies, for `open_maps`."""
    offsets, position = {}, 0
    for piece in pieces:  # all alive together, so their ids are distinct
        offsets[id(piece)] = position
        position += len(piece)
    path = write_atomic(path, pieces)
    layout: Layout = {blob.name: (offsets[id(blob.data)], blob.dtype, tuple(blob.shape)) for blob in blobs
                      if id(blob.data) in offsets and blob.dtype != "bfloat16" and blob.nbytes > 0}
    return path, layout


def open_maps(path: Path, layout: Layout) -> dict[str, np.ndarray]:
    """Read-only maps of the tensors `write_mapped` placed in `path`. A map whose pages were never read is not
    in the process's memory; fresh maps drop the pages earlier maps had read."""
    return {name: np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", offset=offset, shape=shape)
            for name, (offset, dtype, shape) in layout.items()}


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the format's own limit


def safetensors_layout(path: Path) -> Layout | None:
    """Where each tensor of a safetensors file lies, for `open_maps`; None when one cannot be mapped (bfloat16,
    empty) or the header does not describe the file exactly. The safetensors library reads into new arrays
    and has no way to map them; its format is a length, a JSON header and the raw little-endian bytes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            length = int.from_bytes(fh.read(8), "little")
            if not 0 < length <= min(_MAX_SAFETENSORS_HEADER, size - 8):
                return None
            header = json.loads(fh.read(length))
        layout: Layout = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = _SAFETENSORS_DTYPES.get(entry["dtype"]), tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
            if dtype is None or start < 0 or end > size - 8 - length or min(shape, default=1) < 0 \
                    or end - start != math.prod(shape) * np.dtype(dtype).itemsize or end == start:
                return None
            layout[name] = (8 + length + start, dtype, shape)
        return layout
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("%s: cannot map it (%s); loading it instead", path, exc)
        return None


def drop_read_pages(weights: Mapping[str, np.ndarray]) -> None:
    """Take the pages read through maps among `weights` out of this process's memory now, whoever else still
    holds the maps (they stay valid; a later read faults the pages back in from the page cache)."""
    for array in weights.values():
        if isinstance(array, np.memmap):
            release_pages(array.reshape(-1), 0, array.size)


def _best_file_named_by(path: Path) -> str | None:
    """The best-round file a checkpoint names, read from its first fields only (`best` precedes the tensors);
    None when it names none or cannot be read (then no best file is kept on its account)."""
    try:
        with open(path, "rb") as fh:
            unpacker = msgpack.Unpacker(fh, raw=False, max_buffer_size=1 << 20, max_ext_len=0)
            for _ in range(unpacker.read_map_header()):
                key = unpacker.unpack()
                if key == "tensors":
                    return None  # an older layout, or no best: nothing before the tensors named a file
                if key == "best":
                    best = unpacker.unpack()
                    name = best.get("file") if isinstance(best, dict) else None
                    return name if isinstance(name, str) and re.fullmatch(BEST_FILE_PATTERN, name) else None
                unpacker.skip()
    except (OSError, ValueError, msgpack.UnpackException):
        return None
    return None
