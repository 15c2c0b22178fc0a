"""Scoring on the CPU in batches of CPU_BATCH_ROWS gives every row the same bits as the 1024-row batches it
replaced (fedmqtt.training.evaluate): a run's metrics, and with them its best round, do not change."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedmqtt.data.base import TaskInfo  # noqa: E402
from fedmqtt.training.evaluate import CPU_BATCH_ROWS, batch_rows, predict  # noqa: E402
from fedmqtt.training.models import build_model  # noqa: E402
from fedmqtt.training.weights import initial_arrays, load_arrays  # noqa: E402

MULTICLASS = TaskInfo(kind="multiclass", n_outputs=11)

# The zoo's own models with the inputs they take; row counts leave a short last batch at both sizes.
CASES: list[tuple[str, dict[str, Any], tuple[int, ...], TaskInfo | None]] = [
    ("lenet5", {"n_classes": 11, "in_channels": 1, "norm": "bn"}, (1300, 1, 28, 28), MULTICLASS),
    ("lenet5", {"n_classes": 11, "in_channels": 3, "norm": "gn"}, (1100, 3, 28, 28), MULTICLASS),
    ("lenet5", {"n_classes": 11, "in_channels": 1, "norm": "none"}, (1100, 1, 28, 28), MULTICLASS),
    ("mlp", {"in_features": 13, "norm": "bn"}, (1500, 13), None),
    ("gru", {"n_features": 37}, (1100, 24, 37), None),
    ("transformer", {"n_features": 37}, (1100, 24, 37), None),
    ("resnet1d_se", {"in_leads": 12, "n_outputs": 5}, (300, 12, 250), None),
]


def test_the_cpu_scores_in_smaller_batches_and_other_devices_keep_1024() -> None:
    assert batch_rows("cpu") == CPU_BATCH_ROWS < 1024
    assert batch_rows(torch.device("cpu")) == CPU_BATCH_ROWS
    assert batch_rows("cuda:0") == batch_rows("mps") == 1024


@pytest.mark.parametrize(("name", "args", "shape", "task"), CASES,
                         ids=[f"{c[0]}-{c[1].get('norm', '')}" for c in CASES])
def test_every_row_scores_the_same_bits_at_either_batch_size(name: str, args: dict[str, Any],
                                                              shape: tuple[int, ...], task: TaskInfo | None) -> None:
    torch.set_num_threads(1)  # as a site scores
    model = build_model(name, args)
    load_arrays(model, initial_arrays(name, args, 3))
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        model.train()  # running statistics away from (0, 1), as after training
        warm = np.random.default_rng(1).normal(1.0, 2.0, size=(64, *shape[1:]))
        with torch.no_grad():
            model(torch.as_tensor(warm, dtype=torch.float32))
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    kw: dict[str, Any] = {} if task is None else {"task": task}
    default = predict(model, x, **kw)  # CPU_BATCH_ROWS
    before = predict(model, x, batch_size=1024, **kw)
    assert default.tobytes() == before.tobytes()
    assert np.array_equal(predict(model, x, batch_size=CPU_BATCH_ROWS, **kw), default)
