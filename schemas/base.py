"""Frozen base model and the header every message carries."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"


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
    round: int = Field(ge=0)
    msg_id: str = Field(default_factory=new_msg_id, min_length=8, max_length=64)
    sent_at: float = Field(default_factory=time.time)
