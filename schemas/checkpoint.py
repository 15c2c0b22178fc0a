"""Checkpoint: what the PS persists after every aggregation (msgpack, same tensor rules as the wire)."""

from __future__ import annotations

from typing import Any, Literal

from schemas.base import Frozen
from schemas.tensors import TensorBlob


class BestRoundRecord(Frozen):
    round: int
    score: float
    model_hash: str
    tensors: tuple[TensorBlob, ...]


class Checkpoint(Frozen):
    kind: Literal["checkpoint"] = "checkpoint"
    schema_version: Literal[1] = 1
    run_id: str
    config_hash: str
    phase: Literal["training", "evaluating"]
    round: int
    model_hash: str
    tensors: tuple[TensorBlob, ...]
    selected: tuple[str, ...]
    accepted_rounds: dict[str, int] = {}
    history: tuple[dict[str, Any], ...]
    best: BestRoundRecord | None = None
    strategy_state: dict[str, Any] = {}  # tensors inside travel as {"__tensor__": TensorBlob fields}
    manifest: dict[str, dict[str, Any]] = {}
    enrolled: dict[str, int] = {}
    personal: dict[str, tuple[TensorBlob, ...]] = {}
    extras: dict[str, tuple[TensorBlob, ...]] = {}
    recruited: tuple[str, ...] | None = None
    recruitment: dict[str, Any] | None = None
    session: str = ""
    saved_at: float
