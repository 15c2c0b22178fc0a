"""Resource accounting of a local round, and the precision choice (CPU here; the GPU path is documented in
docs/benchmarks.md and needs a CUDA machine to run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmqtt.training.loop import train_local
from fedmqtt.training.models import build_model
from fedmqtt.training.usage import UsageMeter, pick_amp
from ps_daemon.report import usage_section
from schemas.messages import TrainSettings


def test_cpu_round_reports_cpu_seconds_and_no_gpu_figures() -> None:
    # Prepare
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(512, 13)).astype(np.float32), rng.integers(0, 2, 512).astype(np.float32)
    model = build_model("mlp", {"in_features": 13, "hidden": [256, 256]})
    # Execute
    with UsageMeter("cpu") as meter:
        train_local(model, x, y, TrainSettings(epochs=3, batch_size=32), seed=0)
    u = meter.usage
    # Assert
    assert u is not None and u.device == "cpu" and u.amp is None
    assert 0 < u.cpu_s and 0 < u.wall_s
    assert u.energy_j is None and u.gpu_util_pct is None and u.gpu_peak_mem_mb is None


@pytest.mark.parametrize(("choice", "device", "expected"), [
    ("auto", "cpu", None), ("bf16", "cpu", None), ("off", "cuda", None), ("bf16", "cuda", "bfloat16")])
def test_amp_is_bfloat16_on_cuda_only(choice, device, expected) -> None:
    assert pick_amp(choice, device) == expected


@pytest.mark.parametrize(("bf16", "expected"), [(True, "bfloat16"), (False, None)])
def test_amp_auto_follows_the_gpus_bfloat16_support(monkeypatch, bf16, expected) -> None:
    # What torch says of the GPU, set here: the decision runs on the CPU too.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    assert pick_amp("auto", "cuda") == expected
    assert pick_amp("auto", "cuda:1") == expected
    assert pick_amp("auto", "cpu") is None


def test_amp_auto_without_a_gpu_is_full_precision() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the no-GPU answer cannot be checked here")
    assert pick_amp("auto", "cuda") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch's bfloat16 query of a real GPU)")
def test_amp_auto_follows_the_gpu() -> None:
    expected = "bfloat16" if torch.cuda.is_bf16_supported() else None
    assert pick_amp("auto", "cuda") == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU memory and synchronisation)")
def test_cuda_round_reports_gpu_memory() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(512, 13)).astype(np.float32), rng.integers(0, 2, 512).astype(np.float32)
    model = build_model("mlp", {"in_features": 13, "hidden": [256, 256]}).to("cuda")
    with UsageMeter("cuda", "bfloat16") as meter:
        train_local(model, x, y, TrainSettings(epochs=1, batch_size=32), seed=0, device="cuda", amp="bfloat16")
    u = meter.usage
    assert u is not None and u.device == "cuda" and u.amp == "bfloat16"
    assert 0 < u.wall_s and u.gpu_peak_mem_mb is not None and u.gpu_peak_mem_mb > 0


def test_usage_totals_per_site_and_missing_energy_stays_missing() -> None:
    usage = {1: {"a": {"wall_s": 1.0, "cpu_s": 2.0, "energy_j": None},
                 "b": {"wall_s": 2.0, "cpu_s": 1.0, "energy_j": 5.0}},
             2: {"a": {"wall_s": 1.5, "cpu_s": 2.5, "energy_j": None},
                 "b": {"wall_s": 2.0, "cpu_s": 1.0, "energy_j": 7.0}}}
    totals = usage_section(usage)["per_site_total"]
    assert totals["a"] == {"rounds": 2, "wall_s": 2.5, "cpu_s": 4.5, "energy_j": None}
    assert totals["b"] == {"rounds": 2, "wall_s": 4.0, "cpu_s": 2.0, "energy_j": 12.0}
