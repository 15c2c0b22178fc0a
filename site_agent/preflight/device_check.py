"""Where the agent will train: the device it would pick (its own `pick_device`), the GPU's memory and driver,
or the CPU's cores; a config that asks for CUDA on a machine without it fails here rather than at round 1."""

from __future__ import annotations

from site_agent.config import SiteConfig
from site_agent.preflight.findings import Finding, failed, passed, warned

DEVICE = "device"
LOW_GPU_MEMORY = 1 << 30  # free bytes under which a GPU is most likely busy with someone else's work
GIB = float(1 << 30)


def check_device(config: SiteConfig) -> Finding:
    from fedmqtt.training.device_probe import inventory
    from fedmqtt.training.usage import pick_amp
    from site_agent.trainer import pick_device

    inv = inventory()
    facts = {"torch": inv.torch_version, "cuda_runtime": inv.cuda_runtime, "driver": inv.driver,
             "cpu_cores": inv.cpu_cores, "threads": config.threads,
             "gpus": [{"index": g.index, "name": g.name, "free_bytes": g.free_bytes, "total_bytes": g.total_bytes,
                       "capability": g.capability, "bf16": g.bf16} for g in inv.gpus]}
    try:
        device = pick_device(config.device)
    except RuntimeError:
        if not inv.cuda_build:
            return failed(DEVICE, f"device = \"cuda\" but torch {inv.torch_version} is a CPU-only build",
                          "Install torch's CUDA build for this machine's driver (`pip install torch` from the CUDA "
                          "index PyTorch names for your CUDA version), or set device = \"cpu\" in the site config.",
                          **facts)
        driver = f"driver {inv.driver}" if inv.driver else "no NVIDIA driver answers (nvidia-smi)"
        return failed(DEVICE, f"device = \"cuda\" but torch {inv.torch_version} (CUDA {inv.cuda_runtime}) sees no "
                      f"GPU; {driver}", "Check `nvidia-smi` lists the GPU and CUDA_VISIBLE_DEVICES does not hide it; "
                      "a driver older than torch's CUDA runtime needs updating. Or set device = \"cpu\".", **facts)
    facts["device"] = device
    if device == "cpu":
        if not inv.cuda_build:
            build = "CPU-only build"
        elif inv.gpus:  # device = "cpu" chosen although a GPU is there: say so, the site may want it
            build = f"CUDA {inv.cuda_runtime} build; {len(inv.gpus)} GPU(s) visible but not used ({inv.gpus[0].name})"
        else:
            build = f"CUDA {inv.cuda_runtime} build, no GPU visible"
        found = (f"CPU, {inv.cpu_cores} cores, threads = {config.threads} (device = {config.device}; torch "
                 f"{inv.torch_version}, {build})")
        if config.threads > inv.cpu_cores:
            return warned(DEVICE, found, f"threads = {config.threads} but this process may use {inv.cpu_cores} "
                          f"cores: set threads = {inv.cpu_cores} or fewer in the site config.", **facts)
        return passed(DEVICE, found, **facts)
    gpu = inv.gpus[0] if inv.gpus else None
    amp = pick_amp(config.amp, device)
    facts["amp"] = amp
    if gpu is None:  # torch said CUDA is available but listed nothing: report it as it is
        return warned(DEVICE, "CUDA available but no GPU listed", "Check `nvidia-smi`.", **facts)
    others = f" (1 of {len(inv.gpus)} GPUs)" if len(inv.gpus) > 1 else ""
    found = (f"CUDA: {gpu.name}{others}, {gpu.free_bytes / GIB:.1f} of {gpu.total_bytes / GIB:.1f} GiB free, "
             f"compute {gpu.capability}{', bf16' if gpu.bf16 else ''}; driver {inv.driver or 'unknown'}, CUDA "
             f"{inv.cuda_runtime}, torch {inv.torch_version}; amp {amp or 'off'}")
    if config.amp == "bf16" and not gpu.bf16:
        return warned(DEVICE, found, f"amp = \"bf16\" but {gpu.name} has no bfloat16 support: set amp = \"auto\" "
                      "(full precision there) in the site config.", **facts)
    if gpu.free_bytes < LOW_GPU_MEMORY:
        return warned(DEVICE, found, f"Only {gpu.free_bytes / GIB:.2f} GiB free on the GPU: other processes use it "
                      "(`nvidia-smi` lists them); free it or set CUDA_VISIBLE_DEVICES to an idle GPU.", **facts)
    return passed(DEVICE, found, **facts)
