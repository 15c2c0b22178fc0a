"""The agent's durable memory: each uplink payload is saved atomically before it is published,
so a restarted agent re-publishes the stored bytes instead of training again (docs/algorithms.md 0.6)."""

from __future__ import annotations

from pathlib import Path

from fedmqtt.atomic import SPARE_FROM, make_spare, private_dir, write_atomic
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
        # Until the store holds KEEP of them, a spare file made for the purpose is written over instead.
        doomed = sorted({*self._stored(kind), path})[:-KEEP]
        recycle = doomed[0] if doomed and doomed[0] != path else self._spare(kind)
        write_atomic(path, payload, recycle=recycle)
        self._prune(kind)
        self._provide_spares(kind, path)
        return path

    def _spares(self, kind: str) -> list[Path]:
        return sorted(self.folder.glob(f"{kind}.spare*"))

    def _spare(self, kind: str) -> Path | None:
        spares = self._spares(kind)
        return spares[0] if spares else None

    def _provide_spares(self, kind: str, written: Path) -> None:
        """While fewer than KEEP payloads of a kind are stored, make spare files of `written`'s size for the
        saves to come, so that no round after the first pays a new model-sized file's pages (33 against 3 ms
        of CPU at 16 MB on the test machine): the same files the store would create in its next rounds, made
        once per process, in the save that first finds them missing (a site's first round; after a restart,
        its first save). Never more model-sized files than before: stored ones and spares together are at
        most KEEP, which the store reaches by its third round anyway. Spares are not part of what the store
        keeps: `_stored` never lists them, and a crash leaves at most unused ones, taken by later saves."""
        stored, spares = len(self._stored(kind)), self._spares(kind)
        if stored >= KEEP:
            for spare in spares:  # left by a crash or by a restart with older payloads on disk: no longer needed
                spare.unlink(missing_ok=True)
            return
        size = written.stat().st_size
        if size < SPARE_FROM:
            return
        missing = KEEP - stored - len(spares)
        for i in range(KEEP):
            if missing <= 0:
                break
            if make_spare(self.folder / f"{kind}.spare{i}", size):
                missing -= 1

    def _stored(self, kind: str) -> list[Path]:
        return sorted(self.folder.glob(f"{kind}-r*.msgpack"))

    def _prune(self, kind: str) -> None:
        for old in self._stored(kind)[:-KEEP]:
            old.unlink(missing_ok=True)
