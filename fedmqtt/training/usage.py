"""What one local round costs a site: wall and CPU seconds everywhere; on NVIDIA GPUs also energy, load, memory.

Energy comes from NVML's total-energy counter (millijoules since the driver loaded; Volta and newer), read
before and after the round, so it covers the whole GPU, other work on it included: on a shared GPU it is an
upper bound. NVML is optional (`pip install nvidia-ml-py`, the `gpu` extra); without it, or on the CPU, the
GPU fields are None and the CPU seconds are the cost measure.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from schemas.messages import ResourceUsage

log = logging.getLogger(__name__)


def _nvml_handle(device: torch.device) -> Any | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:  # NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES renumbers them for torch
            index = torch.cuda._get_nvml_device_index(index)
        except Exception:  # noqa: BLE001 - private helper; the plain index is right without CUDA_VISIBLE_DEVICES
            pass
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:  # noqa: BLE001 - no driver, no permission: measure without NVML
        log.info("NVML unavailable (%s): no energy or utilisation figures", exc)
        return None


def _energy_mj(handle: Any) -> float | None:
    import pynvml

    try:
        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    except Exception:  # noqa: BLE001 - pre-Volta GPUs do not have the counter
        return None


class UsageMeter:
    """`with UsageMeter(device, amp) as meter: train...`; then `meter.usage`."""

    def __init__(self, device: str, amp: str | None = None, *, sample_s: float = 0.1) -> None:
        self.device = torch.device(device)
        self.amp = amp
        self.sample_s = sample_s
        self.usage: ResourceUsage | None = None
        self._handle: Any | None = None
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> UsageMeter:
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._handle = _nvml_handle(self.device)
        self._energy0 = _energy_mj(self._handle) if self._handle is not None else None
        if self._handle is not None:
            self._thread = threading.Thread(target=self._sample, name="nvml-sampler", daemon=True)
            self._thread.start()
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()
        return self

    def _sample(self) -> None:
        import pynvml

        while not self._stop.wait(self.sample_s):
            try:
                self._samples.append(float(pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
            except Exception:  # noqa: BLE001
                return

    def __exit__(self, *exc: object) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)  # kernels are asynchronous: count them in this round
        wall, cpu = time.perf_counter() - self._wall0, time.process_time() - self._cpu0
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        energy = None
        if self._energy0 is not None:
            end = _energy_mj(self._handle)
            energy = (end - self._energy0) / 1000.0 if end is not None else None
        self.usage = ResourceUsage(
            device=str(self.device), wall_s=wall, cpu_s=cpu, energy_j=energy,
            gpu_util_pct=sum(self._samples) / len(self._samples) if self._samples else None,
            gpu_peak_mem_mb=torch.cuda.max_memory_allocated(self.device) / 2**20 if self._cuda else None,
            amp=self.amp)


def pick_amp(choice: str, device: str) -> str | None:
    """`auto`: bfloat16 autocast on a CUDA GPU that supports it (no loss scaling needed), else full precision.
    Never on the CPU, where bf16 autocast is slow on most processors and would change results."""
    if choice == "off" or not device.startswith("cuda"):
        return None
    if choice == "bf16" or (choice == "auto" and torch.cuda.is_bf16_supported()):
        return "bfloat16"
    return None
