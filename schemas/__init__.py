"""Wire schemas: the single source of truth for every payload fedmqtt sends."""

from schemas.base import SCHEMA_VERSION
from schemas.messages import (
    ClientUpdate,
    DaemonStatus,
    EvalReport,
    EvalTask,
    GlobalModel,
    Message,
    RoundMetrics,
    SiteStatus,
    TrainTask,
)
from schemas.tensors import TensorBlob, arrays_to_blobs, blobs_to_arrays

__all__ = [
    "SCHEMA_VERSION",
    "ClientUpdate",
    "DaemonStatus",
    "EvalReport",
    "EvalTask",
    "GlobalModel",
    "Message",
    "RoundMetrics",
    "SiteStatus",
    "TensorBlob",
    "TrainTask",
    "arrays_to_blobs",
    "blobs_to_arrays",
]
