"""One site's local training with nothing around it: the 'training memory' that bench/many_sites.py subtracts
from a site process's peak to see what the federation itself costs a site.

Same as a site agent's round (bundled heart-disease data of site 0, the model spec, the PS's train settings,
a validation pass, one local training run, the resulting weights as numpy arrays), but no broker, no messages,
no durable state. Prints one JSON line: {"peak_mb": VmHWM of this process}.

    python bench/train_alone.py '{"name": "mlp", "args": {...}}' '{"epochs": 1, ...}'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from fedmqtt.data.heart_disease import SITES, bundled_path
    from fedmqtt.data.registry import load_site_data
    from fedmqtt.data.spec import DataSpec
    from fedmqtt.training.weights import initial_arrays
    from schemas.messages import ModelSpec, TrainSettings
    from site_agent.trainer import Trainer, use_threads

    spec, settings = ModelSpec(**json.loads(sys.argv[1])), TrainSettings(**json.loads(sys.argv[2]))
    use_threads(1)
    data = load_site_data(DataSpec.model_validate({"format": "heart_disease", "path": str(bundled_path(SITES[0])),
                                                   "split_seed": 0}))
    weights = initial_arrays(spec.name, dict(spec.args), 0)
    result = Trainer("site-000", data).train(spec, weights, settings, 1)
    assert result.weights
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            print(json.dumps({"peak_mb": int(line.split()[1]) / 1024}))


if __name__ == "__main__":
    main()
