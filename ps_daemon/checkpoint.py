"""Durable checkpoints: one file per round, written atomically (temp file, fsync, os.replace)."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedmqtt.atomic import write_atomic
from fedmqtt.errors import CheckpointError, SchemaError
from ps_daemon.state import BestRound, DaemonState, RoundRecord
from schemas.checkpoint import BestRoundRecord, Checkpoint
from schemas.codec import decode_checkpoint, encode_checkpoint
from fedmqtt.strategies.base import Manifest, manifest_from_dict
from schemas.tensors import TensorBlob, arrays_to_blobs, blobs_to_arrays

log = logging.getLogger(__name__)


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


def state_to_checkpoint(state: DaemonState, *, run_id: str, config_hash: str) -> Checkpoint:
    best = None
    if state.best is not None:
        b = state.best
        best = BestRoundRecord(round=b.round, score=b.score, model_hash=b.model_hash, tensors=arrays_to_blobs(b.weights))
    return Checkpoint(
        run_id=run_id, config_hash=config_hash, phase=state.phase, round=state.round,
        model_hash=state.model_hash, tensors=arrays_to_blobs(state.weights), selected=state.selected,
        accepted_rounds=dict(state.accepted_rounds),
        history=tuple(dataclasses.asdict(r) for r in state.history), best=best,
        strategy_state=_pack(dict(state.strategy_state)), manifest=_manifest_to_dict(state.manifest),
        enrolled=dict(state.enrolled), personal={k: arrays_to_blobs(v) for k, v in state.personal.items()},
        extras={k: arrays_to_blobs(v) for k, v in state.extras.items()}, saved_at=time.time(),
        recruited=state.recruited, recruitment=None if state.recruitment is None else dict(state.recruitment),
        session=state.session,
    )


def checkpoint_to_state(ckpt: Checkpoint) -> DaemonState:
    history = tuple(
        RoundRecord(**{**h, "sites": tuple(h["sites"]), "stragglers": tuple(h["stragglers"])}) for h in ckpt.history
    )
    best = None
    if ckpt.best is not None:
        best = BestRound(ckpt.best.round, ckpt.best.score, _copy(blobs_to_arrays(ckpt.best.tensors)), ckpt.best.model_hash)
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
        self.folder.mkdir(parents=True, exist_ok=True)
        path = write_atomic(self.folder / f"round-{ckpt.round:06d}.ckpt", encode_checkpoint(ckpt))
        for old in self._files()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self) -> Path | None:
        """The newest checkpoint file, if any."""
        files = self._files()
        return files[-1] if files else None

    def clear(self) -> int:
        """Remove every checkpoint (a forced fresh start); returns how many there were."""
        files = self._files()
        for path in files:
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
            return ckpt
        raise CheckpointError(f"no readable checkpoint in {self.folder}")
