"""What this machine offers for training, as `fedmqtt site check` reports it: the CUDA GPUs torch sees (name,
free and total memory, bfloat16), the driver and the CUDA runtime torch was built with, or the CPU.

The driver version comes from NVML when it is installed (`nvidia-ml-py`, the `gpu` extra), else from
`nvidia-smi`; torch itself only knows the runtime it was built with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    free_bytes: int
    total_bytes: int
    capability: str  # compute capability, "9.0"
    bf16: bool


@dataclass(frozen=True)
class DeviceInventory:
    torch_version: str
    cuda_runtime: str | None  # the CUDA version torch was built with (None: a CPU-only build)
    driver: str | None  # the NVIDIA driver's version, when NVML or nvidia-smi says it
    gpus: tuple[Gpu, ...]
    cpu_cores: int  # the cores this process may run on (a container's or taskset's share)

    @property
    def cuda_build(self) -> bool:
        return self.cuda_runtime is not None


def inventory() -> DeviceInventory:
    """Look, without training anything: reading a GPU's free memory creates a CUDA context on it (briefly)."""
    gpus: list[Gpu] = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            with torch.cuda.device(index):
                bf16 = bool(torch.cuda.is_bf16_supported())
            gpus.append(Gpu(index, props.name, int(free), int(total), f"{props.major}.{props.minor}", bf16))
    return DeviceInventory(torch_version=torch.__version__, cuda_runtime=torch.version.cuda,
                           driver=driver_version() if torch.version.cuda else None, gpus=tuple(gpus),
                           cpu_cores=cpu_cores())


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def driver_version() -> str | None:
    """The NVIDIA driver's version: NVML, else nvidia-smi; None when neither answers (no driver)."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - not installed, no driver, no permission: ask nvidia-smi
        pass
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        out = subprocess.run([tool, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None
