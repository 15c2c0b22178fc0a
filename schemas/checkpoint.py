"""Checkpoint: what the PS persists after every aggregation (msgpack, same tensor rules as the wire)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from schemas.base import Frozen
from schemas.tensors import TensorBlob

BEST_FILE_PATTERN = r"^best-round-[0-9]{6}\.msgpack$"


class BestRoundRecord(Frozen):
    """The best round's model: its tensors inline, or (what the PS writes) in a file of its own beside the
    checkpoints, written once when the round becomes the best instead of again in every checkpoint."""

    round: int
    score: float
    model_hash: str
    tensors: tuple[TensorBlob, ...] = ()
    file: str = Field(default="", pattern=f"({BEST_FILE_PATTERN})|^$")  # a bare name in the checkpoint folder
    sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")  # of that file's bytes


class Checkpoint(Frozen):
    kind: Literal["checkpoint"] = "checkpoint"
    schema_version: Literal[1] = 1
    run_id: str
    config_hash: str
    phase: Literal["training", "evaluating"]
    round: int
    model_hash: str
    best: BestRoundRecord | None = None  # before the tensors: a reader finds the best file without reading them
    tensors: tuple[TensorBlob, ...]
    selected: tuple[str, ...]
    accepted_rounds: dict[str, int] = {}
    history: tuple[dict[str, Any], ...]
    strategy_state: dict[str, Any] = {}  # tensors inside travel as {"__tensor__": TensorBlob fields}
    manifest: dict[str, dict[str, Any]] = {}
    enrolled: dict[str, int] = {}
    personal: dict[str, tuple[TensorBlob, ...]] = {}
    extras: dict[str, tuple[TensorBlob, ...]] = {}
    recruited: tuple[str, ...] | None = None
    recruitment: dict[str, Any] | None = None
    session: str = ""
    saved_at: float
