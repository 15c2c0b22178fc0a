"""Updates of the open round on disk, so the PS's memory stays flat in the number of sites.

Each arriving update's tensor bytes go to one file; the strategy later reads them through
`SpooledTensors`, one tensor of one site at a time, in ascending site order. Why not running sums
at arrival time: float addition is not associative, so sums in arrival order would make the
result depend on network timing; sorted order keeps simulation, deployment and resume
bit-identical, and the disk (page cache) holds what RAM need not.
"""

from __future__ import annotations

import mmap
import shutil
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from fedmqtt.atomic import private_dir, write_atomic
from schemas.tensors import TensorBlob

# What numpy can map; bfloat16 has no numpy dtype (and no model the PS holds uses it).
_NUMPY_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"})


class SpooledTensors(Mapping[str, np.ndarray]):
    """Read-only tensors backed by a spool file. The file is mapped once, at the first lookup, and each lookup
    is a view into that map (mapping afresh per lookup cost ~0.1 ms each, twice per tensor and update a round).
    Nothing is copied or cached in RAM: when a view of at least a page is freed, its pages leave this process's
    resident memory (they stay in the kernel's page cache), so the PS holds no more of N sites' updates than
    its callers do, as when every lookup had its own map. `release` drops the map with the round's spool."""

    def __init__(self, path: Path, index: dict[str, tuple[int, str, tuple[int, ...]]]) -> None:
        self.path = path
        self.index = index
        self._map: np.memmap | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        offset, dtype, shape = self.index[name]
        dt = np.dtype(dtype).newbyteorder("<")
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, dtype=dt)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        # A plain array whose base is the map, so aggregate.release_pages finds the map and the view's byte
        # offset in it. Offsets need not be aligned: numpy reads unaligned elements correctly.
        view = np.ndarray(shape, dtype=dt, buffer=self._map, offset=offset)
        if view.nbytes >= mmap.PAGESIZE:  # smaller ones hold at most two pages each while the round is open
            handle = getattr(self._map, "_mmap", None)  # the mmap.mmap numpy maps the file with
            if handle is not None and hasattr(handle, "madvise"):
                begin = offset - offset % mmap.PAGESIZE
                weakref.finalize(view, _drop_pages, handle, begin, offset + view.nbytes - begin).atexit = False
        return view

    def release(self) -> None:
        """Forget the map (the file is being removed); a later lookup would map the file again."""
        self._map = None

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def _drop_pages(handle: mmap.mmap, begin: int, length: int) -> None:
    """Drop a freed view's pages from resident memory; another view of them faults them back in from the page
    cache (the map is read-only, so nothing is lost)."""
    if not handle.closed:
        handle.madvise(mmap.MADV_DONTNEED, begin, length)


class UpdateSpool:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        shutil.rmtree(self.folder, ignore_errors=True)  # leftovers of a crashed run are re-sent by the sites
        private_dir(self.folder)
        self.spooled: dict[int, list[SpooledTensors]] = {}  # per round: what put handed out, released on drop

    def put(self, round_no: int, site: str, blobs: tuple[TensorBlob, ...]) -> SpooledTensors:
        """Store an ACCEPTED update (the caller has checked round, sender, first-wins and the tensors' layout
        against the model): atomically, so a reader never maps half a file and a crash leaves no torn one."""
        directory = self.folder / f"round-{round_no:06d}"
        directory.mkdir(exist_ok=True, mode=0o700)
        path = directory / f"{site}.bin"
        index: dict[str, tuple[int, str, tuple[int, ...]]] = {}
        offset = 0
        for blob in blobs:
            if blob.dtype not in _NUMPY_DTYPES:
                raise ValueError(f"tensor {blob.name!r}: {blob.dtype} cannot be spooled (the model has no such tensor)")
            index[blob.name] = (offset, blob.dtype, tuple(blob.shape))
            offset += len(blob.data)
        write_atomic(path, (blob.data for blob in blobs), durable=False)  # wiped at every start
        tensors = SpooledTensors(path, index)
        self.spooled.setdefault(round_no, []).append(tensors)
        return tensors

    def drop_before(self, round_no: int) -> None:
        """Remove the spool of every round before `round_no` (closed rounds), and release their maps."""
        for old in [r for r in self.spooled if r < round_no]:
            for tensors in self.spooled.pop(old):
                tensors.release()
        for directory in self.folder.glob("round-*"):
            if int(directory.name.split("-")[1]) < round_no:
                shutil.rmtree(directory, ignore_errors=True)


__all__ = ["SpooledTensors", "UpdateSpool"]
