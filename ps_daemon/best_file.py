"""The best round's weights in a file of their own (`best-round-<r>.msgpack`), named by the checkpoints.

A module of its own because both the state (whose `BestRound` may hold such a file instead of arrays) and the
checkpoint store use it, and the checkpoint store needs the state: here, neither imports the other.
"""

from __future__ import annotations

import hashlib
import mmap
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np

from fedmqtt.errors import CheckpointError
from schemas.checkpoint import BestRoundRecord
from schemas.msgpack_views import unpack_with_views
from schemas.tensors import blobs_to_arrays


@dataclass(frozen=True)
class StoredWeights:
    """Weights kept in a best-round file instead of memory; `load` reads them back (checked against the hash)."""

    path: Path
    sha256: str

    def load(self) -> dict[str, np.ndarray]:
        """Read-only views of the file, mapped, not read into memory: its pages are in the PS's memory only while
        they are read (the hash check, a writer), and the page cache keeps them; nothing is copied."""
        try:
            with open(self.path, "rb") as fh:
                data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # missing, unreadable or empty (an empty file cannot be mapped)
            data = None
        if data is None or hashlib.sha256(data).hexdigest() != self.sha256:
            raise CheckpointError(f"{self.path} is missing or damaged (its SHA-256 does not match the checkpoint's)")
        try:
            obj = unpack_with_views(data, max_bin_len=len(data), max_str_len=len(data), max_array_len=len(data),
                                    max_map_len=len(data), max_containers=len(data), max_depth=64)
            if obj is None:  # a layout the view reader does not take: copy it out, as before
                obj = msgpack.unpackb(data, raw=False, max_ext_len=0)
            record = BestRoundRecord.model_validate(obj)
            return blobs_to_arrays(record.tensors)  # read-only views of the mapped file
        except (ValueError, TypeError, msgpack.UnpackException, RecursionError, MemoryError) as exc:
            raise CheckpointError(f"{self.path} is unreadable: {type(exc).__name__}: {str(exc)[:200]}") from None
