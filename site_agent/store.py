"""The agent's durable memory: each uplink payload is saved atomically before it is published,
so a restarted agent re-publishes the stored bytes instead of training again (docs/algorithms.md 0.6)."""

from __future__ import annotations

from pathlib import Path

from fedmqtt.atomic import private_dir, write_atomic
from schemas.codec import Encoded


class UplinkStore:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        private_dir(self.folder)

    def _path(self, kind: str, round_no: int, model_hash: str) -> Path:
        return self.folder / f"{kind}-r{round_no:06d}-{model_hash[:16]}.msgpack"

    def load(self, kind: str, round_no: int, model_hash: str) -> bytes | None:
        path = self._path(kind, round_no, model_hash)
        return path.read_bytes() if path.is_file() else None

    def save(self, kind: str, round_no: int, model_hash: str, payload: Encoded) -> Path:
        """Durable before it returns; `payload` as bytes or as the pieces of one encoding, written in order."""
        path = write_atomic(self._path(kind, round_no, model_hash), payload)
        self._prune(kind, keep=3)
        return path

    def _prune(self, kind: str, *, keep: int) -> None:
        for old in sorted(self.folder.glob(f"{kind}-r*.msgpack"))[:-keep]:
            old.unlink(missing_ok=True)
