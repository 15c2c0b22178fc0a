"""Round 1 from a pretrained model: the `init_model` file, validated against the model's manifest. numpy only.

The file was written by someone else (a public checkpoint, another project's pretraining), so it is
hostile input: its size is checked before anything is read, its header is read only through the
safetensors library, and every tensor's name, dtype and shape is checked against the manifest before
its data is read; every loaded tensor must be finite (a BatchNorm variance also non-negative, a count
non-negative). A refusal is an `InitModelError` that names the file and the tensor.

Two modes (`InitModelConfig.tensors`):
- "all": the file is exactly the model's state (every tensor, nothing else);
- "matching": the tensors with the model's name, dtype and shape are loaded, every other tensor of the
  model keeps its own seeded initialisation (e.g. a head pretrained for another number of classes), and
  the file's other tensors are ignored with the reason. At least one tensor must load.
Nothing is frozen: the file only sets the starting point.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedmqtt.errors import ConfigError

# safetensors' header dtype codes as numpy names (a model's tensors are float32 or int64:
# fedmqtt.training.models.wire_dtype); an unknown code is reported as it stands
_HEADER_DTYPE = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                 "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
# A file may hold more than the model (another head, an optimiser's leftovers) in "matching" mode; past this
# many times the model's own bytes, plus this slack for the header, it is refused before it is opened.
SIZE_FACTOR = 2
HEADER_SLACK_BYTES = 1 << 20


class InitModelError(ConfigError):
    """The init_model file cannot start this model; the message names the file and the tensor."""


class InitModelChanged(InitModelError):
    """The file's sha256 is not the one recorded for it earlier (`recorded_sha256`): another file's bytes."""

    def __init__(self, message: str, *, recorded: str, found: str) -> None:
        super().__init__(message)
        self.recorded, self.found = recorded, found


@dataclass(frozen=True)
class InitRecord:
    """What the file did to the round-1 model: for the log and the run report."""

    path: str
    sha256: str
    tensors: str
    loaded: list[str]
    kept: list[str]
    ignored: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "tensors": self.tensors, "loaded": list(self.loaded),
                "kept": list(self.kept), "ignored": dict(self.ignored)}


def model_bytes(manifest: Mapping[str, Mapping[str, Any]]) -> int:
    return sum(math.prod(int(d) for d in spec["shape"]) * np.dtype(str(spec["dtype"])).itemsize
               for spec in manifest.values())


def size_limit(manifest: Mapping[str, Mapping[str, Any]], max_bytes: int | None) -> int:
    return max_bytes if max_bytes is not None else SIZE_FACTOR * model_bytes(manifest) + HEADER_SLACK_BYTES


def load_init_model(path: Path, weights: Mapping[str, np.ndarray], manifest: Mapping[str, Mapping[str, Any]], *,
                    tensors: Literal["all", "matching"] = "all",
                    max_bytes: int | None = None, what: str = "init_model",
                    recorded_sha256: str | None = None) -> tuple[dict[str, np.ndarray], InitRecord]:
    """`weights` (the model's own seeded initialisation) with the file's tensors put in, and the record.

    Raises InitModelError for a file that is too large, unreadable, or holds a tensor that does not fit
    (in "all" mode any difference from the manifest; in both modes a non-finite or out-of-range value).
    `recorded_sha256`: what the file hashed to when it was loaded before (a run resumed before round 1 closed);
    a file that hashes otherwise raises InitModelChanged before any of its tensors is read."""
    from safetensors import safe_open

    where = f"{what} {path}"
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise InitModelError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    limit = size_limit(manifest, max_bytes)
    if size > limit:
        raise InitModelError(f"{where}: {size} bytes, more than the {limit} this model allows "
                             "(init_model.max_bytes raises the limit)")
    sha256 = _sha256(path)  # of the file as it was when the run started (the report names it)
    if recorded_sha256 is not None and sha256 != recorded_sha256:
        raise InitModelChanged(f"{where}: sha256 {sha256}, not the {recorded_sha256} recorded when it was "
                               "loaded before", recorded=recorded_sha256, found=sha256)
    plan, ignored = _plan(path, manifest, tensors, where)
    out, loaded = dict(weights), []
    try:
        with safe_open(str(path), framework="numpy") as f:
            for name in plan:
                out[name] = _checked(f.get_tensor(name), name, manifest[name], where)
                loaded.append(name)
    except InitModelError:
        raise
    except Exception as exc:  # the library's own refusal of a header or data it cannot read
        raise InitModelError(f"{where}: not a readable safetensors file ({exc})") from None
    kept = [name for name in manifest if name not in plan]
    return out, InitRecord(path=str(path), sha256=sha256, tensors=tensors, loaded=loaded, kept=kept,
                           ignored=ignored)


def _plan(path: Path, manifest: Mapping[str, Mapping[str, Any]], tensors: str,
          where: str) -> tuple[list[str], dict[str, str]]:
    """From the header alone: which tensors to load (in manifest order), and why the others are ignored."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            header = {name: (f.get_slice(name).get_dtype(), list(f.get_slice(name).get_shape())) for name in f.keys()}
    except Exception as exc:  # the library refuses a malformed header; say so by name
        raise InitModelError(f"{where}: not a readable safetensors file ({exc})") from None
    ignored: dict[str, str] = {}
    plan: list[str] = []
    for name, (code, shape) in sorted(header.items()):
        spec = manifest.get(name)
        dtype = _HEADER_DTYPE.get(code, code)
        if spec is None:
            ignored[name] = "not in the model"
        elif dtype != spec["dtype"]:
            ignored[name] = f"dtype {dtype}, the model has {spec['dtype']}"
        elif shape != [int(d) for d in spec["shape"]]:
            ignored[name] = f"shape {shape}, the model has {list(spec['shape'])}"
    if tensors == "all":
        if ignored:
            name, why = next(iter(ignored.items()))
            raise InitModelError(f"{where}: tensor {name!r}: {why} (tensors = \"all\" needs the "
                                 "model's exact state; \"matching\" loads only the tensors that fit)")
        missing = [name for name in manifest if name not in header]
        if missing:
            raise InitModelError(f"{where}: tensor {missing[0]!r} of the model is missing"
                                 f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    plan = [name for name in manifest if name in header and name not in ignored]
    if not plan:
        raise InitModelError(f"{where}: no tensor has the model's name, dtype and shape: is it "
                             "a checkpoint of this model?")
    return plan, ignored


def _checked(array: np.ndarray, name: str, spec: Mapping[str, Any], where: str) -> np.ndarray:
    """The tensor as loaded, checked again (the data, not only the header) and made read-only."""
    if str(array.dtype) != spec["dtype"] or list(array.shape) != [int(d) for d in spec["shape"]]:
        raise InitModelError(f"{where}: tensor {name!r} reads as {array.dtype} {list(array.shape)}, "
                             f"the model has {spec['dtype']} {list(spec['shape'])}")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise InitModelError(f"{where}: tensor {name!r} holds NaN or infinity")
    if array.size and (name.endswith("running_var") or "INTBUF" in spec["tags"]) and array.min() < 0:
        raise InitModelError(f"{where}: tensor {name!r} holds a negative value (a variance or a "
                             "count)")
    out = np.require(array, requirements="C")  # (ascontiguousarray would make a 0-d count 1-d)
    out.flags.writeable = False
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
