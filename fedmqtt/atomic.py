"""Durable file writes: temp file, fsync, os.replace, fsync of the folder (a crash leaves old or new, never half)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def write_atomic(path: Path, data: bytes | Iterable[bytes], *, durable: bool = True) -> Path:
    """Write `data` (bytes, or pieces written one after another without joining them) to `path` so that a
    crash at any moment leaves either the old or the new file. `durable=False` skips the fsyncs, for files that
    a restart throws away anyway (the PS's update spool): still never torn, just not forced to disk."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        for piece in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
            fh.write(piece)
        fh.flush()
        if durable:
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    if not durable:
        return path
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path
