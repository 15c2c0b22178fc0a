"""The round-1 model: its weights and tensor manifest, made by a short-lived child process that has torch."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from typing import Any

from fedmqtt.atomic import private_dir, write_private_text
from ps_daemon.checkpoint import open_maps, safetensors_layout
from ps_daemon.config import DaemonConfig
from ps_daemon.init_model_file import load_init_model
from schemas.tensors import arrays_to_blobs, tensors_hash

log = logging.getLogger("fedmqtt.ps")
# What `init_model` loaded and kept, written at a fresh start and read into the run report (also after --resume).
INIT_RECORD_FILE = "init_model.json"


def hash_weights(weights: dict) -> str:
    """A model version's id (`model_hash`): the hash of its tensors as they go on the wire."""
    return tensors_hash(arrays_to_blobs(weights))


def initial_model(config: DaemonConfig) -> tuple[dict, dict]:
    """Round-1 weights and the tensor manifest from the model registry (docs/algorithms.md 0.2), with the
    `init_model` file's tensors put in where it is set (the same function in a simulation and a deployment,
    so both start from the same bits).
    """
    weights, manifest = _seeded_model(config)
    record_path = config.out_dir / INIT_RECORD_FILE
    if config.init_model is None:
        record_path.unlink(missing_ok=True)  # an earlier start's record does not describe this one
        return weights, manifest
    init = config.init_model
    weights, record = load_init_model(init.path, weights, manifest, tensors=init.tensors, max_bytes=init.max_bytes)
    log.info("init_model %s (sha256 %s, tensors = %r): loaded %d tensor(s): %s; kept the seeded initialisation "
             "of %d: %s%s", record.path, record.sha256[:16], record.tensors, len(record.loaded),
             ", ".join(record.loaded), len(record.kept), ", ".join(record.kept) or "none",
             "".join(f"; ignored {name} ({why})" for name, why in record.ignored.items()))
    private_dir(config.out_dir)
    write_private_text(record_path, json.dumps(record.as_dict(), indent=2))
    return weights, manifest


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
