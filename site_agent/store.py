"""The agent's durable memory: each uplink payload is saved atomically before it is published,
so a restarted agent re-publishes the stored bytes instead of training again (docs/algorithms.md 0.6)."""

from __future__ import annotations

from pathlib import Path

from fedmqtt.atomic import private_dir, write_atomic
from schemas.codec import Encoded

KEEP = 3  # stored payloads of a kind: the newest rounds'


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
        path = self._path(kind, round_no, model_hash)
        # The file the pruning below deletes once this one is in place (an older round's) becomes the new one's
        # temporary file: its pages are written over, not freed while as many new ones are allocated.
        doomed = sorted({*self._stored(kind), path})[:-KEEP]
        recycle = doomed[0] if doomed and doomed[0] != path else None
        write_atomic(path, payload, recycle=recycle)
        self._prune(kind)
        return path

    def _stored(self, kind: str) -> list[Path]:
        return sorted(self.folder.glob(f"{kind}-r*.msgpack"))

    def _prune(self, kind: str) -> None:
        for old in self._stored(kind)[:-KEEP]:
            old.unlink(missing_ok=True)
