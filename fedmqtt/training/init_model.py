"""`python -m fedmqtt.training.init_model SPEC_JSON OUT_DIR`: round-1 weights and manifest of a model.

Run by the PS in a child process, so the daemon itself never loads torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.numpy import save_file

from fedmqtt.atomic import private_dir, replace_atomic, write_private_text
from fedmqtt.training.models import model_manifest
from fedmqtt.training.weights import initial_arrays


def main(spec_json: str, out_dir: str) -> None:
    spec = json.loads(spec_json)
    out = private_dir(Path(out_dir))  # inside the PS's private out_dir, and as private as the rest of it
    arrays = initial_arrays(spec["name"], spec["args"], int(spec["seed"]))
    replace_atomic(out / "weights.safetensors", lambda tmp: save_file(arrays, str(tmp)))
    write_private_text(out / "manifest.json", json.dumps(model_manifest(spec["name"], spec["args"])))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
