"""The best round's weights in a file of their own (`best-round-<r>.msgpack`), named by the checkpoints.

A module of its own because both the state (whose `BestRound` may hold such a file instead of arrays) and the
checkpoint store use it, and the checkpoint store needs the state: here, neither imports the other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np

from fedmqtt.errors import CheckpointError
from schemas.checkpoint import BestRoundRecord
from schemas.tensors import blobs_to_arrays


@dataclass(frozen=True)
class StoredWeights:
    """Weights kept in a best-round file instead of memory; `load` reads them back (checked against the hash)."""

    path: Path
    sha256: str

    def load(self) -> dict[str, np.ndarray]:
        data = self.path.read_bytes() if self.path.is_file() else b""
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise CheckpointError(f"{self.path} is missing or damaged (its SHA-256 does not match the checkpoint's)")
        try:
            record = BestRoundRecord.model_validate(msgpack.unpackb(data, raw=False, max_ext_len=0))
            return blobs_to_arrays(record.tensors)  # read-only views of the decoded bytes
        except (ValueError, TypeError, msgpack.UnpackException, RecursionError, MemoryError) as exc:
            raise CheckpointError(f"{self.path} is unreadable: {type(exc).__name__}: {str(exc)[:200]}") from None
