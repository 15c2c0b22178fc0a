"""The round-1 model: its weights and tensor manifest, made by a short-lived child process that has torch."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from fedmqtt.atomic import private_dir, write_private_text
from fedmqtt.errors import CheckpointError
from ps_daemon.checkpoint import open_maps, safetensors_layout
from ps_daemon.config import DaemonConfig
from ps_daemon.init_model_file import InitModelChanged, InitModelError, load_init_model
from schemas.tensors import arrays_to_blobs, tensors_hash

log = logging.getLogger("fedmqtt.ps")
# What `init_model` loaded and kept, written at a fresh start and read into the run report (also after --resume).
INIT_RECORD_FILE = "init_model.json"
MAX_RECORD_BYTES = 1 << 20  # its lists name the model's tensors: far below this for any model
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FIX = ("A resumed run starts from the model it started with: put the file it started from back at "
        "init_model.path, or start the run afresh without --resume (round 1 has not closed, so no checkpoint is lost)")


def hash_weights(weights: dict) -> str:
    """A model version's id (`model_hash`): the hash of its tensors as they go on the wire."""
    return tensors_hash(arrays_to_blobs(weights))


def initial_model(config: DaemonConfig, *, resume: bool = False) -> tuple[dict, dict]:
    """Round-1 weights and the tensor manifest from the model registry (docs/algorithms.md 0.2), with the
    `init_model` file's tensors put in where it is set (the same function in a simulation and a deployment,
    so both start from the same bits).

    `resume`: a `--resume` before round 1 closed (no checkpoint yet), whose round-1 model may be out already:
    the file must be the one the run's first start loaded (its sha256 in INIT_RECORD_FILE), or the PS refuses
    to start rather than hand the sites another model under the same run.
    """
    record_path = config.out_dir / INIT_RECORD_FILE
    recorded = _recorded_start(record_path) if resume else None
    if config.init_model is None and recorded is not None:
        raise InitModelError(
            f"--resume: this run started from init_model {recorded['path']} (sha256 {recorded['sha256']}), but "
            f"the config sets no [init_model] now. {_FIX}")
    weights, manifest = _seeded_model(config)
    if config.init_model is None:
        record_path.unlink(missing_ok=True)  # an earlier start's record does not describe this one
        return weights, manifest
    init = config.init_model
    try:
        weights, record = load_init_model(init.path, weights, manifest, tensors=init.tensors, max_bytes=init.max_bytes,
                                          recorded_sha256=None if recorded is None else recorded["sha256"])
    except InitModelChanged as exc:
        raise InitModelError(
            f"--resume: init_model {init.path} has sha256 {exc.found}, but this run started from a file with "
            f"sha256 {exc.recorded} (then at {recorded['path'] if recorded else '?'}; recorded in {record_path}). "
            f"{_FIX}") from None
    if recorded is not None:
        log.info("--resume: init_model %s is the file this run started from (sha256 %s)", record.path,
                 record.sha256[:16])
    log.info("init_model %s (sha256 %s, tensors = %r): loaded %d tensor(s): %s; kept the seeded initialisation "
             "of %d: %s%s", record.path, record.sha256[:16], record.tensors, len(record.loaded),
             ", ".join(record.loaded), len(record.kept), ", ".join(record.kept) or "none",
             "".join(f"; ignored {name} ({why})" for name, why in record.ignored.items()))
    private_dir(config.out_dir)
    write_private_text(record_path, json.dumps(record.as_dict(), indent=2))
    return weights, manifest


def _recorded_start(path: Path) -> dict[str, str] | None:
    """The path and sha256 of the init_model file the run's first start loaded; None when it loaded none."""
    if not path.is_file():
        return None
    try:  # the PS's own file in its private out_dir, still read as one that may have been damaged
        loaded = json.loads(path.read_text()) if path.stat().st_size <= MAX_RECORD_BYTES else None
    except (OSError, ValueError):
        loaded = None
    sha256 = loaded.get("sha256") if isinstance(loaded, dict) else None
    where = loaded.get("path") if isinstance(loaded, dict) else None
    if not (isinstance(sha256, str) and _SHA256.fullmatch(sha256) and isinstance(where, str)):
        raise CheckpointError(f"{path}: not the record of an init_model file this version writes (path and "
                              "sha256), so --resume cannot tell whether init_model is the file the run started "
                              "from; start the run afresh without --resume (round 1 has not closed)")
    return {"path": where, "sha256": sha256}


def init_record(config: DaemonConfig) -> dict[str, Any] | None:
    """The run report's `init_model`: what the file loaded and kept, as recorded at the run's fresh start."""
    path = config.out_dir / INIT_RECORD_FILE
    if config.init_model is None or not path.is_file():
        return None
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def _seeded_model(config: DaemonConfig) -> tuple[dict, dict]:
    """Round-1 weights (the model's own seeded initialisation) and the tensor manifest.

    Both need torch (the model's own initialisation, its module types). The PS daemon never imports
    torch itself: it asks a short-lived child process (`fedmqtt.training.init_model`), so its own
    memory stays small. In a simulation torch is loaded already and is used directly.
    """
    args = dict(config.model.args)
    if "torch" in sys.modules:
        from fedmqtt.training.models import model_manifest
        from fedmqtt.training.weights import initial_arrays

        return initial_arrays(config.model.name, args, config.seed), model_manifest(config.model.name, args)
    from safetensors.numpy import load_file

    out = config.out_dir / "initial"
    private_dir(out)
    spec = json.dumps({"name": config.model.name, "args": args, "seed": config.seed})
    done = subprocess.run([sys.executable, "-m", "fedmqtt.training.init_model", spec, str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"could not initialise model {config.model.name!r} (needs torch: fedmqtt[site]):\n"
                         f"{done.stderr[-2000:]}")
    path = out / "weights.safetensors"
    layout = safetensors_layout(path)  # read-only maps: the weights take no memory until a publish reads them
    weights = open_maps(path, layout) if layout is not None else load_file(str(path))
    return weights, json.loads((out / "manifest.json").read_text())
