"""Tensors on the wire: name, dtype, shape and raw little-endian bytes. No pickle, no base64.

This is the only module that converts between numpy arrays and wire blobs.
"""

from __future__ import annotations

import math
from typing import Literal, Mapping

import numpy as np
from pydantic import Field, model_validator

from schemas.base import Frozen

# Only plain numeric dtypes may cross the wire; object or structured dtypes never do.
DType = Literal["float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool"]
_FLOAT_DTYPES = {"float16", "float32", "float64"}
_ITEMSIZE = {
    "float16": 2, "float32": 4, "float64": 8, "bfloat16": 2,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "bool": 1,
}
MAX_TENSOR_NAME = 256


class TensorBlob(Frozen):
    """One named tensor. Validation checks byte length against shape and rejects NaN/Inf."""

    name: str = Field(min_length=1, max_length=MAX_TENSOR_NAME)
    dtype: DType
    shape: tuple[int, ...]
    data: bytes

    @model_validator(mode="after")
    def _check(self) -> "TensorBlob":
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")
        expected = math.prod(self.shape) * _ITEMSIZE[self.dtype]
        if len(self.data) != expected:
            raise ValueError(
                f"tensor {self.name!r}: {len(self.data)} bytes, but shape {self.shape} x {self.dtype} "
                f"needs {expected}"
            )
        if self.dtype in _FLOAT_DTYPES:
            values = np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<"))
            if not np.isfinite(values).all():
                raise ValueError(f"tensor {self.name!r}: contains NaN or Inf")
        return self

    def to_numpy(self) -> np.ndarray:
        """A read-only view of the bytes (no copy)."""
        if self.dtype == "bfloat16":
            raise ValueError(f"tensor {self.name!r}: bfloat16 needs torch to decode")
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)

    @classmethod
    def from_numpy(cls, name: str, array: np.ndarray) -> "TensorBlob":
        dtype = str(array.dtype)
        if dtype not in _ITEMSIZE:
            raise ValueError(f"tensor {name!r}: dtype {dtype} is not allowed on the wire")
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        return cls(name=name, dtype=dtype, shape=tuple(int(d) for d in array.shape), data=little.tobytes())

    @property
    def nbytes(self) -> int:
        return len(self.data)


def arrays_to_blobs(arrays: Mapping[str, np.ndarray]) -> tuple[TensorBlob, ...]:
    """Blobs in sorted name order, so the same weights always encode to the same bytes."""
    return tuple(TensorBlob.from_numpy(name, arrays[name]) for name in sorted(arrays))


def blobs_to_arrays(blobs: tuple[TensorBlob, ...] | list[TensorBlob]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for blob in blobs:
        if blob.name in out:
            raise ValueError(f"tensor {blob.name!r} appears twice")
        out[blob.name] = blob.to_numpy()
    return out


def tensors_hash(blobs: tuple[TensorBlob, ...] | list[TensorBlob]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes in name order: identifies a model version."""
    import hashlib

    digest = hashlib.sha256()
    for blob in sorted(blobs, key=lambda b: b.name):
        digest.update(f"{blob.name}|{blob.dtype}|{blob.shape}|".encode())
        digest.update(blob.data)
    return digest.hexdigest()
