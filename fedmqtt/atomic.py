"""Durable, private file writes: temp file, fsync, os.replace, fsync of the folder (a crash leaves old or new, never
half). What a party writes (states, uplinks, checkpoints, spool, reports, models) is its own and may hold what
others must not read: files are 0600 and folders 0700 from the moment they exist, whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

Piece = bytes | bytearray | memoryview  # anything a binary file's write() takes
PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700
# Set inside `volatile_writes()`: a simulation, which never resumes, forces nothing to disk.
_VOLATILE: ContextVar[bool] = ContextVar("fedmqtt_volatile_writes", default=False)


@contextmanager
def volatile_writes() -> Iterator[None]:
    """Within this block `write_atomic` and `replace_atomic` skip their fsyncs: files stay atomic (never torn,
    0600) but are left to the OS to flush. For a simulation: every party runs in one process that starts afresh
    and never resumes, so nothing it writes during the run is read after a crash, and on a busy machine each
    fsync made the run wait for other processes' disk writes (about 45 a round with 20 sites)."""
    token = _VOLATILE.set(True)
    try:
        yield
    finally:
        _VOLATILE.reset(token)


def private_dir(path: Path) -> Path:
    """Make `path` a folder only its owner may enter (0700), tightening one that exists: it is this party's own
    folder. Missing folders above it are made 0700 too; existing ones are left as they are."""
    path = Path(path)
    for missing in reversed([p for p in (path, *path.parents) if not p.exists()]):
        missing.mkdir(exist_ok=True, mode=PRIVATE_DIR)
        missing.chmod(PRIVATE_DIR)  # mkdir's mode passes through the umask
    if path.stat().st_mode & 0o777 != PRIVATE_DIR:
        path.chmod(PRIVATE_DIR)
    return path


def write_private_text(path: Path, text: str) -> Path:
    """`text` (UTF-8) to `path` as write_atomic does, 0600 (reports and other text a party writes)."""
    return write_atomic(path, text.encode("utf-8"))


def write_atomic(path: Path, data: Piece | Iterable[Piece], *, durable: bool = True,
                 recycle: Path | None = None) -> Path:
    """Write `data` (bytes, or pieces written one after another without joining them) to `path` so that a
    crash at any moment leaves either the old or the new file. `durable=False` skips the fsyncs, for files that
    a restart throws away anyway (the PS's update spool): still never torn, just not forced to disk.

    `recycle`: a file of the same folder that the caller deletes once `path` is written (an older stored update).
    It becomes the temporary file and is overwritten in place: its cached pages are reused instead of freed
    while as many are allocated and zeroed for a new file (3 of the 6 ms a 16 MB file cost). Nothing else
    changes for `path`: the temporary file is never read, and it is fsynced before it takes `path`'s name. The
    only difference is `recycle`'s: after a crash while writing it is already gone, where the caller would have
    deleted it next."""
    pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if recycle is not None and Path(recycle) != path and _take_over(Path(recycle), tmp):
        with open(tmp, "r+b") as fh:  # not "wb": truncating first would free the pages we came for
            for piece in pieces:
                fh.write(piece)
            fh.truncate()
        return _put_in_place(tmp, path, durable=durable)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:  # made 0600 by replace_atomic; truncating keeps that mode
            for piece in pieces:
                fh.write(piece)

    return replace_atomic(path, write, durable=durable)


def _take_over(old: Path, tmp: Path) -> bool:
    """Rename `old` (a regular file of ours with no other name: writing over it in place must change nothing
    anyone reads) to `tmp`; False if it is not such a file, which is then left as it is."""
    try:
        info = os.lstat(old)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            return False
        os.replace(old, tmp)
    except OSError:
        return False
    os.chmod(tmp, PRIVATE_FILE)
    return True


def replace_atomic(path: Path, write: Callable[[Path], None], *, durable: bool = True) -> Path:
    """Let `write` create a temporary file (for writers that take a file name, such as safetensors' save_file,
    which writes straight from the arrays' memory), then put it in place as `write_atomic` does."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE))  # 0600 before a byte is in it
    write(tmp)
    return _put_in_place(tmp, path, durable=durable)


def _put_in_place(tmp: Path, path: Path, *, durable: bool) -> Path:
    """fsync `tmp` (if durable), rename it to `path`, fsync the folder (if durable)."""
    durable = durable and not _VOLATILE.get()
    os.chmod(tmp, PRIVATE_FILE)  # a writer that replaced the file rather than truncating it
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


_ZEROS = bytes(1 << 20)
SPARE_FROM = 1 << 20  # files from this size on are worth a spare (see `make_spare`); smaller ones gain little


def make_spare(path: Path, size: int) -> bool:
    """Create `path` as a private file of `size` zero bytes, written but not forced to disk, for a later
    `write_atomic(..., recycle=path)` to write over; False (nothing done) if `path` exists.

    Why: the pages of a new file cost far more than writing over a file's cached pages (33 against 3 ms of CPU
    for 16 MB on this project's test machine, a VM; docs/benchmarks.md, bench/file_pages.py). A store that will hold
    several model-sized files calls this once, when it writes its first one, so that the files it would
    otherwise create in the next rounds exist already: the same pages, paid for once per process instead of in
    each of the first rounds. Its content is never read (the next write replaces it whole), so it is not
    fsynced; a crash leaves at most a stray spare, which the store takes or deletes like any other."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as fh:
        for start in range(0, size, len(_ZEROS)):
            fh.write(memoryview(_ZEROS)[:min(len(_ZEROS), size - start)])
    return True
