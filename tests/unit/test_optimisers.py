"""The site's optimisers compute exactly what torch.optim's classes compute, without importing torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from fedmqtt.training.optimisers import LocalOptimiser  # noqa: E402

CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _train(make, *, seed: int, steps: int, dtype: torch.dtype, frozen: bool) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)).to(dtype)
    if frozen:  # a parameter without a gradient is skipped, as torch.optim does
        model[0].bias.requires_grad_(False)
    opt = make(list(model.parameters()))
    data = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=data, dtype=dtype)
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(CLASSES)), lr=st.sampled_from([1e-3, 0.05, 0.5]),
       weight_decay=st.sampled_from([0.0, 1e-4, 0.1]), momentum=st.sampled_from([0.0, 0.5, 0.9]),
       nesterov=st.booleans(), seed=st.integers(0, 2**16), steps=st.integers(1, 7),
       dtype=st.sampled_from([torch.float32, torch.float64]), frozen=st.booleans())
def test_weights_equal_torch_optim_bit_for_bit(kind: str, lr: float, weight_decay: float, momentum: float,
                                               nesterov: bool, seed: int, steps: int, dtype: torch.dtype,
                                               frozen: bool) -> None:
    sgd = {"momentum": momentum, "nesterov": nesterov and momentum > 0} if kind == "sgd" else {}
    ours = _train(lambda p: LocalOptimiser(p, kind, lr=lr, weight_decay=weight_decay, **sgd),
                  seed=seed, steps=steps, dtype=dtype, frozen=frozen)
    theirs = _train(lambda p: CLASSES[kind](p, lr=lr, weight_decay=weight_decay, **sgd),
                    seed=seed, steps=steps, dtype=dtype, frozen=frozen)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_settings_that_torch_refuses_are_refused() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="Nesterov"):
        LocalOptimiser(p, "sgd", lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="Nesterov"):
        LocalOptimiser(p, "adam", lr=0.1, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match=">= 0"):
        LocalOptimiser(p, "adam", lr=-1.0)
    with pytest.raises(ValueError, match="unknown optimiser"):
        LocalOptimiser(p, "lbfgs", lr=0.1)


def test_a_site_trains_without_importing_torch_dynamo(tmp_path) -> None:
    """The reason the module exists: whole runs in a fresh process (sites' training with each optimiser,
    FedDyn's clipping, evaluation, the server rule) leave torch._dynamo unimported (0.8 CPU s and 70 MB per
    site process in torch 2.13)."""
    code = f"""
import sys
from pathlib import Path
from fedmqtt.simulation import SGD_TRAIN, SimulationConfig, run_simulation
from schemas.messages import TrainSettings
runs = [("fedavg", TrainSettings()), ("fedavg", TrainSettings(optimizer="adamw")),
        ("fedavg", SGD_TRAIN.model_copy(update={{"hyper": {{"momentum": 0.9, "nesterov": 1.0}}}})),
        ("feddyn", SGD_TRAIN)]
for i, (algorithm, train) in enumerate(runs):
    run_simulation(SimulationConfig(algorithm=algorithm, rounds=1, train=train,
                                    out_dir=Path({str(tmp_path)!r}) / str(i)), progress=False)
assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
