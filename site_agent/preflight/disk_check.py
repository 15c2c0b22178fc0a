"""The state directory: the agent's own (0700), writable, with room for what it keeps of the model.

What the agent keeps there, in model sizes: its last 3 uplinks (site_agent/store.py), the pending and committed
local state (local_state.py), the evaluated and best models (BestSlot), and one of these being written: about
MODEL_COPIES in all. With the model's size unknown (no model published yet, no earlier run here), the check asks
for DEFAULT_FREE_BYTES and only warns below it.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from site_agent.preflight.config_checks import user_name
from site_agent.preflight.findings import Finding, failed, passed, warned

STATE = "state dir"
MODEL_COPIES = 8
MARGIN_BYTES = 64 << 20
DEFAULT_FREE_BYTES = 1 << 30
GIB = float(1 << 30)


def stored_model_bytes(state_dir: Path) -> int | None:
    """The largest uplink or model an earlier run left in the state directory: this federation's model size."""
    sizes = [p.stat().st_size for sub, pattern in (("uplink", "*.msgpack"), ("best", "*.safetensors"))
             for p in (state_dir / sub).glob(pattern) if p.is_file()]
    return max(sizes) if sizes else None


def needed_bytes(model_bytes: int | None) -> int:
    return MODEL_COPIES * model_bytes + MARGIN_BYTES if model_bytes else DEFAULT_FREE_BYTES


def check_state_dir(state_dir: Path, model_bytes: int | None) -> Finding:
    if state_dir.exists() and not state_dir.is_dir():
        return failed(STATE, f"{state_dir} is a file, not a folder", "Remove it or set state_dir in the site "
                      "config to a folder of its own.")
    there = state_dir if state_dir.exists() else next(p for p in state_dir.parents if p.exists())
    if there == state_dir:
        st = state_dir.stat()
        if st.st_uid != os.geteuid():
            return failed(STATE, f"{state_dir} belongs to {user_name(st.st_uid)}, not to {user_name(os.geteuid())}",
                          f"Make it the agent's own: `sudo chown -R {user_name(os.geteuid())} {state_dir}`.")
    problem = _cannot_write(there)
    if problem:
        what = f"{state_dir} is not writable" if there == state_dir else f"cannot create {state_dir} in {there}"
        return failed(STATE, f"{what} ({problem})", f"Create it as the agent's user: `mkdir -p -m 700 {state_dir}`, "
                      "on a file system mounted read-write.")
    free = shutil.disk_usage(there).free
    need = needed_bytes(model_bytes)
    basis = (f"{MODEL_COPIES} x the {model_bytes / 2**20:.1f} MB model" if model_bytes
             else "default; the model's size is not known yet")
    if there == state_dir:
        mode = _mode(state_dir)
        privacy = "private (0700)" if mode == 0o700 else f"mode {mode:04o}"
        where = f"{state_dir}: {privacy}, writable"
    else:
        where = f"{state_dir}: not there yet (the agent creates it, 0700)"
    found = f"{where}; {free / GIB:.1f} GiB free, needs {need / GIB:.1f} GiB ({basis})"
    facts = {"path": str(state_dir), "exists": there == state_dir, "free_bytes": free, "needed_bytes": need,
             "model_bytes": model_bytes}
    if free < need:
        fix = (f"Free {(need - free) / GIB:.1f} GiB on the file system of {there}, or set state_dir in the site config "
               "to a folder on a larger one.")
        return failed(STATE, found, fix, **facts) if model_bytes else warned(STATE, found, fix, **facts)
    if there == state_dir and _mode(state_dir) != 0o700:
        return warned(STATE, found, f"Others may look inside: `chmod 700 {state_dir}` (the agent also does this when "
                      "it starts).", **facts)
    return passed(STATE, found, **facts)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cannot_write(folder: Path) -> str:
    """Why a file cannot be made in `folder` (empty when it can): tried, because permissions alone do not tell
    about read-only mounts, ACLs or a full disk."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".fedmqtt-check-"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""
