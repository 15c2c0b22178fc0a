"""Updates of the open round on disk, so the PS's memory stays flat in the number of sites.

Each arriving update's tensor bytes go to one file; the strategy later reads them through
`SpooledTensors`, one tensor of one site at a time, in ascending site order. Why not running sums
at arrival time: float addition is not associative, so sums in arrival order would make the
result depend on network timing; sorted order keeps simulation, deployment and resume
bit-identical, and the disk (page cache) holds what RAM need not.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from fedmqtt.atomic import private_dir, write_atomic
from schemas.tensors import TensorBlob

# What numpy can map; bfloat16 has no numpy dtype (and no model the PS holds uses it).
_NUMPY_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"})


class SpooledTensors(Mapping[str, np.ndarray]):
    """Read-only tensors backed by a spool file; each lookup maps it afresh (nothing is cached)."""

    def __init__(self, path: Path, index: dict[str, tuple[int, str, tuple[int, ...]]]) -> None:
        self.path = path
        self.index = index

    def __getitem__(self, name: str) -> np.ndarray:
        offset, dtype, shape = self.index[name]
        dt = np.dtype(dtype).newbyteorder("<")
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, dtype=dt)
        return np.memmap(self.path, dtype=dt, mode="r", offset=offset, shape=shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


class UpdateSpool:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        shutil.rmtree(self.folder, ignore_errors=True)  # leftovers of a crashed run are re-sent by the sites
        private_dir(self.folder)

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
        return SpooledTensors(path, index)

    def drop_before(self, round_no: int) -> None:
        """Remove the spool of every round before `round_no` (closed rounds)."""
        for directory in self.folder.glob("round-*"):
            if int(directory.name.split("-")[1]) < round_no:
                shutil.rmtree(directory, ignore_errors=True)


__all__ = ["SpooledTensors", "UpdateSpool"]
