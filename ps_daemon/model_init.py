"""The round-1 model: its weights and tensor manifest, made by a short-lived child process that has torch."""

from __future__ import annotations

import json
import subprocess
import sys

from fedmqtt.atomic import private_dir
from ps_daemon.checkpoint import open_maps, safetensors_layout
from ps_daemon.config import DaemonConfig
from schemas.tensors import arrays_to_blobs, tensors_hash


def hash_weights(weights: dict) -> str:
    """A model version's id (`model_hash`): the hash of its tensors as they go on the wire."""
    return tensors_hash(arrays_to_blobs(weights))


def initial_model(config: DaemonConfig) -> tuple[dict, dict]:
    """Round-1 weights and the tensor manifest from the model registry (docs/algorithms.md 0.2).

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
