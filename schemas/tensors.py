"""Tensors on the wire: name, dtype, shape and raw little-endian bytes. No pickle, no base64.

This is the only module that converts between numpy arrays and wire blobs.

bfloat16 is a first-class wire dtype (CUDA sites train in it) but numpy has no such dtype. So `to_numpy`, whose
contract is a zero-copy view in exactly the wire dtype, refuses bfloat16 with a ValueError that names it, and
`to_float32` is the explicit, lossless way in (a bfloat16 is the upper half of a float32). Refusing instead of
silently upcasting keeps every dtype check downstream honest: an array never claims to be something the wire
did not say.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

import numpy as np
from pydantic import Field, WrapSerializer, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

from schemas.base import MAX_TENSORS, Frozen

# Only plain numeric dtypes may cross the wire; object or structured dtypes never do.
DType = Literal["float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool"]
_WIRE_DTYPE: dict[str, DType] = {name: name for name in get_args(DType)}  # numpy's dtype name -> the wire's
_FLOAT_DTYPES = {"float16", "float32", "float64", "bfloat16"}
_ITEMSIZE = {
    "float16": 2, "float32": 4, "float64": 8, "bfloat16": 2,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "bool": 1,
}
# Exponent bits of the 16-bit floats: all ones means Inf or NaN.
_EXPONENT_MASK_16 = {"float16": 0x7C00, "bfloat16": 0x7F80}
MAX_TENSOR_NAME = 256
MAX_RANK = 16
MAX_DIM = 2**40  # a dimension far above any model; keeps products of the shape cheap to compute

Dim = Annotated[int, Field(ge=0, le=MAX_DIM)]
Shape = Annotated[tuple[Dim, ...], Field(max_length=MAX_RANK)]


_FINITE_BLOCK = 1 << 22  # elements checked at a time: the temporaries stay a few MB for any tensor size


def all_finite(data: bytes | memoryview, dtype: str) -> bool:
    """True if no element of the little-endian `data` of `dtype` is NaN or +-Inf (integers and bools always are)."""
    if dtype not in _FLOAT_DTYPES:
        return True
    mask = _EXPONENT_MASK_16.get(dtype)
    if mask is not None:  # bit test: works for bfloat16, which numpy cannot represent
        values = np.frombuffer(data, dtype="<u2")
        for start in range(0, values.size, _FINITE_BLOCK):
            block = values[start:start + _FINITE_BLOCK]
            if np.any((block & mask) == mask):
                return False
        return True
    values = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"))
    return all(bool(np.isfinite(values[i:i + _FINITE_BLOCK]).all()) for i in range(0, values.size, _FINITE_BLOCK))


def _keep_view(value: object, handler: Any) -> Any:
    """A read-only byte view (what `from_numpy` makes) is kept as it is; anything else is validated as bytes."""
    if isinstance(value, memoryview) and value.readonly and value.format == "B" and value.c_contiguous:
        return value
    return handler(value)


def _dump_view(value: Any, handler: Any, info: Any) -> Any:
    """In Python mode a view goes to the encoder as it is (it writes the bytes once); JSON needs real bytes."""
    if isinstance(value, memoryview):
        return value if info.mode == "python" else handler(bytes(value))
    return handler(value)


# Decoded messages hold `bytes`; blobs made here from arrays hold a read-only view of the array's memory, so
# building a message or checkpoint of a 1 GB model does not first copy that gigabyte. Pydantic validates
# `bytes` (a view passes through `_keep_view`); type checkers see both kinds a blob can hold.
if TYPE_CHECKING:
    TensorBytes = bytes | memoryview
else:
    TensorBytes = Annotated[bytes, WrapValidator(_keep_view), WrapSerializer(_dump_view)]


class TensorBlob(Frozen):
    """One named tensor. Validation checks byte length against shape and rejects NaN/Inf in every float dtype."""

    name: str = Field(min_length=1, max_length=MAX_TENSOR_NAME)
    dtype: DType
    shape: Shape
    data: TensorBytes

    @model_validator(mode="after")
    def _check(self) -> TensorBlob:
        expected = math.prod(self.shape) * _ITEMSIZE[self.dtype]
        if len(self.data) != expected:
            raise PydanticCustomError(
                "tensor_size", "tensor {name}: {got} bytes, but shape {shape} x {dtype} needs {expected}",
                {"name": repr(self.name[:64]), "got": len(self.data), "shape": self.shape, "dtype": self.dtype,
                 "expected": expected})
        if not all_finite(self.data, self.dtype):
            raise PydanticCustomError("non_finite", "tensor {name} ({dtype}): contains NaN or Inf",
                                      {"name": repr(self.name[:64]), "dtype": self.dtype})
        return self

    def to_numpy(self) -> np.ndarray:
        """A read-only view of the bytes (no copy) in the wire dtype; bfloat16 raises (see `to_float32`)."""
        if self.dtype == "bfloat16":
            raise ValueError(f"tensor {self.name[:64]!r}: dtype bfloat16 has no numpy equivalent; "
                             "use TensorBlob.to_float32() for an exact float32 copy")
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)

    def to_float32(self) -> np.ndarray:
        """The values as a new float32 array; exact for bfloat16 and float16, rounding for float64."""
        if self.dtype == "bfloat16":
            widened = np.frombuffer(self.data, dtype="<u2").astype("<u4") << 16
            return widened.view("<f4").reshape(self.shape)
        return self.to_numpy().astype(np.float32)

    @classmethod
    def from_numpy(cls, name: str, array: np.ndarray, *, check: bool = True) -> TensorBlob:
        """A blob aliasing `array`'s memory. `check=False` skips validation (the finiteness scan reads every
        byte): only for arrays the caller made and checked itself, such as a model it holds as maps of a file,
        which the scan would otherwise read into memory whole."""
        dtype = _WIRE_DTYPE.get(str(array.dtype))
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} is not allowed on the wire")
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).view()
        little.flags.writeable = False  # the blob aliases the array (no copy); it never writes through it
        shape, data = tuple(int(d) for d in array.shape), memoryview(little.reshape(-1)).cast("B")
        if not check:
            return cls.model_construct(name=name, dtype=dtype, shape=shape, data=data)
        return cls(name=name, dtype=dtype, shape=shape, data=data)

    @property
    def nbytes(self) -> int:
        return len(self.data)


Tensors = Annotated[tuple[TensorBlob, ...], Field(max_length=MAX_TENSORS)]


def arrays_to_blobs(arrays: Mapping[str, np.ndarray], *, check: bool = True) -> tuple[TensorBlob, ...]:
    """Blobs in sorted name order, so the same weights always encode to the same bytes (`check`: see
    `TensorBlob.from_numpy`)."""
    return tuple(TensorBlob.from_numpy(name, arrays[name], check=check) for name in sorted(arrays))


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
