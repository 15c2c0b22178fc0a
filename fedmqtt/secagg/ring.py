"""Fixed-point encoding of float updates into the ring Z_(2^bits), where secure aggregation adds them.

A site clips every coordinate to [-clip, clip], multiplies by scale = 2^fraction_bits and rounds to the nearest
integer; that integer, taken modulo 2^bits (two's complement), is what it masks and sends. The PS adds the masked
vectors modulo 2^bits, removes the masks and reads the sum back as a signed integer divided by scale.

Why these choices:
- a power-of-two scale makes x * scale exact in float64, so rounding is the only error: at most 1 / (2 * scale)
  per coordinate and site, and at most n / (2 * scale) for the sum of n sites (of the clipped values);
- the sum of n encoded values lies in [-n * q_max, n * q_max] with q_max = ceil(clip * scale); `FixedPoint`
  refuses, when it is built, any (clip, scale, bits, max_sites) for which that interval does not fit the signed
  range of the ring (it would wrap and decode to garbage) or exceeds 2^53 (float64 would no longer hold every
  integer exactly when the sum is decoded);
- the ring is uint32 or uint64 so numpy's own modular arithmetic does the reduction: 4 bytes a coordinate (as many
  as float32) or 8 for a wide range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from fedmqtt.errors import ConfigError

RING_BITS = (32, 64)
EXACT_FLOAT_LIMIT = 2**53  # every integer up to this is a float64
RingVector = npt.NDArray[np.unsignedinteger]


@dataclass(frozen=True)
class FixedPoint:
    """How floats become ring elements, checked so that the sum of up to `max_sites` encodings cannot wrap."""

    clip: float  # every coordinate is clipped to [-clip, clip] before encoding
    fraction_bits: int  # scale = 2^fraction_bits
    bits: Literal[32, 64] = 32  # the ring is Z_(2^bits)
    max_sites: int = 2  # the most encodings that will ever be summed

    def __post_init__(self) -> None:
        if self.bits not in RING_BITS:
            raise ConfigError(f"secure aggregation ring: bits must be one of {RING_BITS}, not {self.bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"secure aggregation ring: clip must be a positive number, not {self.clip}")
        if not 0 <= self.fraction_bits <= 52:
            raise ConfigError(f"secure aggregation ring: fraction_bits must be in [0, 52], not {self.fraction_bits}")
        if self.max_sites < 1:
            raise ConfigError(f"secure aggregation ring: max_sites must be >= 1, not {self.max_sites}")
        limit = min(2 ** (self.bits - 1) - 1, EXACT_FLOAT_LIMIT)
        if self.max_sites * self.q_max > limit:
            raise ConfigError(
                f"secure aggregation ring: the sum of {self.max_sites} sites clipped to +-{self.clip:g} at scale "
                f"2^{self.fraction_bits} reaches {self.max_sites * self.q_max}, beyond the {limit} a "
                f"{self.bits}-bit ring can decode: lower fraction_bits or clip, or use bits=64")

    @property
    def scale(self) -> float:
        return float(2**self.fraction_bits)

    @property
    def q_max(self) -> int:
        """The largest magnitude one encoded coordinate can have."""
        return math.ceil(self.clip * self.scale)

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        return np.uint32 if self.bits == 32 else np.uint64

    @property
    def bytes_per_coordinate(self) -> int:
        return self.bits // 8

    def site_error_bound(self) -> float:
        """The largest |decode(encode(x)) - clip(x)| of one coordinate of one site."""
        return 1.0 / (2.0 * self.scale)

    def sum_error_bound(self, n_sites: int) -> float:
        """The largest error of one coordinate of the decoded sum of `n_sites` encodings (of the clipped values)."""
        return n_sites / (2.0 * self.scale)

    def encode(self, values: npt.NDArray[np.floating]) -> RingVector:
        """The ring elements of a finite float vector (clipped first). Refuses NaN and infinities."""
        wide = np.asarray(values, dtype=np.float64)
        if not np.all(np.isfinite(wide)):
            raise ValueError("secure aggregation encodes finite values only (NaN or infinity in the update)")
        rounded = np.rint(np.clip(wide, -self.clip, self.clip) * self.scale).astype(np.int64)
        return rounded.astype(self.dtype)  # two's complement: a negative q becomes 2^bits + q

    def decode_sum(self, total: RingVector) -> npt.NDArray[np.float64]:
        """The float sum a ring vector stands for (the sum of at most max_sites encodings)."""
        signed = np.asarray(total, dtype=self.dtype).view(np.int32 if self.bits == 32 else np.int64)
        return signed.astype(np.float64) / self.scale

    def zeros(self, length: int) -> RingVector:
        return np.zeros(length, dtype=self.dtype)
