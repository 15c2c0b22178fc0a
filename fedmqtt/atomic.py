"""Durable file writes: temp file, fsync, os.replace, fsync of the folder (a crash leaves old or new, never half)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

Piece = bytes | bytearray | memoryview  # anything a binary file's write() takes


def write_atomic(path: Path, data: Piece | Iterable[Piece], *, durable: bool = True) -> Path:
    """Write `data` (bytes, or pieces written one after another without joining them) to `path` so that a
    crash at any moment leaves either the old or the new file. `durable=False` skips the fsyncs, for files that
    a restart throws away anyway (the PS's update spool): still never torn, just not forced to disk."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            for piece in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                fh.write(piece)

    return replace_atomic(path, write, durable=durable)


def replace_atomic(path: Path, write: Callable[[Path], None], *, durable: bool = True) -> Path:
    """Let `write` create a temporary file (for writers that take a file name, such as safetensors' save_file,
    which writes straight from the arrays' memory), then put it in place as `write_atomic` does."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    if durable:
        with open(tmp, "rb+") as fh:
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
