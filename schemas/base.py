"""Frozen base model, the header every message carries, and the bounded field types all messages share.

Why bounded types: every field arrives from a party we do not fully trust. A number that is NaN, Inf, negative or
astronomically large, a string of megabytes or a map of a million keys is never legitimate, and each one has
crashed, stalled or bloated a receiver somewhere. The bounds below sit far above anything real traffic sends.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION: Final = 1  # Final: its type is Literal[1], what Header.schema_version accepts
ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"

MAX_ROUND = 10_000_000
MAX_COUNT = 2**53  # exact in a float64 and in JSON: sample counts, steps, histogram bins
MAX_SECONDS = 1e9  # ~31 years: durations and CPU time
MAX_TIMESTAMP = 1e11  # seconds since the epoch, year ~5138: sent_at, deadlines
MAX_MAP_ENTRIES = 256  # metric names per map, hyper-parameters, scalars
MAX_SITES = 10_000  # sites named in one status or metrics message
MAX_TENSORS = 100_000  # tensors in one message field
MAX_DETAIL = 2000  # free text for people (status detail, reasons)

MAX_REAL = 1e15  # metric values, losses, scores: 10 000 sites' worth still sums to a finite float64
# A float that is a real number: NaN/Inf would poison means and best-round selection, and JSON cannot spell them.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
# ... and one a receiver can add up: a finite 1e308 from one site would turn a mean into Inf just the same.
Real = Annotated[float, Field(allow_inf_nan=False, ge=-MAX_REAL, le=MAX_REAL)]
NonNegativeSeconds = Annotated[float, Field(allow_inf_nan=False, ge=0, le=MAX_SECONDS)]
Timestamp = Annotated[float, Field(allow_inf_nan=False, ge=0, le=MAX_TIMESTAMP)]
RoundNo = Annotated[int, Field(ge=0, le=MAX_ROUND)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Name = Annotated[str, Field(max_length=128)]  # keys of metric maps, algorithm and tag names
Label = Annotated[str, Field(max_length=256)]  # device descriptions, versions, hashes, tensor names
Detail = Annotated[str, Field(max_length=MAX_DETAIL)]
SiteName = Annotated[str, Field(max_length=64)]
Session = Annotated[str, Field(max_length=64, pattern=r"^[0-9a-f]*$")]


class Frozen(BaseModel):
    """Immutable, strict about unknown fields: a typo in a payload is an error, not a silent drop."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def new_msg_id() -> str:
    return uuid.uuid4().hex


class Header(Frozen):
    """Fields on every message, so receivers can drop duplicates and stale retained replays."""

    schema_version: Literal[1] = SCHEMA_VERSION
    run_id: str = Field(pattern=ID_PATTERN)
    sender: str = Field(pattern=ID_PATTERN)
    round: RoundNo
    # Printable and short: ids end up in logs and in chunk ids, and must never smuggle a newline into either.
    msg_id: str = Field(default_factory=new_msg_id, min_length=8, max_length=64, pattern=r"^[0-9A-Za-z._:-]+$")
    sent_at: Timestamp = Field(default_factory=time.time)
