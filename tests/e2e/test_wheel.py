"""The product as a hospital installs it: the wheel built from this repository, installed in a fresh virtual
environment, run from a directory outside the repository (`broker init`, `broker start`, `ps start`,
`site start` on the bundled heart-disease demo data)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from harness import stop_processes

REPO = Path(__file__).resolve().parents[2]
SITES = ("cleveland", "hungary")

pytestmark = pytest.mark.slow


def _run(*args: str | Path, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _dependency_dir(target: Path) -> Path:
    """The already-installed third-party packages (torch, numpy, paho...) WITHOUT this repository's editable
    fedmqtt: a directory of links to every entry of this environment's site-packages except fedmqtt's own
    (its editable finder and dist-info) and the .pth files. Added to the fresh venv as a plain path entry, so
    its .pth files are never processed and nothing can lead back to the repository."""
    site_packages = Path(sysconfig.get_paths()["purelib"])
    target.mkdir()
    for entry in site_packages.iterdir():
        name = entry.name
        if name.startswith(("fedmqtt", "__editable__", "__pycache__")) or name.endswith(".pth"):
            continue
        (target / name).symlink_to(entry)
    return target


def test_installed_wheel_runs_a_federation_outside_the_repo(mosquitto_bin: str, tmp_path: Path) -> None:
    # Build from a clean copy of the tracked tree (a stale build/ in the checkout cannot leak into the wheel).
    src = tmp_path / "src"
    src.mkdir()
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    with open(tmp_path / "src.tar", "wb") as tar:
        subprocess.run(["tar", "-cf", "-", *files], cwd=REPO, check=True, stdout=tar)
    subprocess.run(["tar", "-xf", str(tmp_path / "src.tar"), "-C", str(src)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    started = time.monotonic()
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
         ".", cwd=src, env=env)
    (wheel,) = (tmp_path / "dist").glob("fedmqtt-*.whl")

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path, env=env)
    py, fedmqtt = venv / "bin" / "python", venv / "bin" / "fedmqtt"
    _run(py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp_path, env=env)
    purelib = _run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path, env=env)
    Path(purelib.strip(), "fedmqtt-deps.pth").write_text(f"{_dependency_dir(tmp_path / 'deps')}\n")
    install_s = time.monotonic() - started

    work = tmp_path / "hospital"  # outside the repository: nothing there can be imported by accident
    work.mkdir()
    where = _run(py, "-c", "import fedmqtt, broker.config as c; print(fedmqtt.__file__); print(c.base_config_path())",
                 cwd=work, env=env).split()
    assert all(p.startswith(str(venv)) for p in where), where
    assert not any(p.startswith(str(REPO)) for p in where)

    fed = work / "fed"
    args = ["broker", "init", "--dir", fed, "--run-id", "wheel"] + [a for s in SITES for a in ("--site", s)]
    _run(fedmqtt, *args, cwd=work, env=env)
    _run(py, "-c", "from pathlib import Path; from broker.federation import load_federation;"
         "from fedmqtt.demo import write_role_configs;"
         f"write_role_configs(load_federation(Path('{fed}')), Path('{work}'), rounds=2, seed=0,"
         "train={'epochs': 1, 'batch_size': 32, 'lr': 0.003, 'optimizer': 'adam'})", cwd=work, env=env)
    logs = work / "logs"
    logs.mkdir()

    def spawn(name: str, *role: str | Path) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "wb") as log:  # the child keeps its own copy of the descriptor
            return subprocess.Popen([str(fedmqtt), *map(str, role)], cwd=work, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)

    procs = {"broker": spawn("broker", "broker", "start", "--dir", fed)}
    try:
        deadline = time.monotonic() + 20
        while not (fed / "broker" / "mosquitto.pid").is_file():
            assert procs["broker"].poll() is None and time.monotonic() < deadline, (logs / "broker.log").read_text()
            time.sleep(0.1)
        procs["ps"] = spawn("ps", "ps", "start", "--config", work / "ps.toml")
        for site in SITES:
            procs[site] = spawn(site, "site", "start", "--config", work / "sites" / f"{site}.toml")
        try:
            rc = procs["ps"].wait(240)
        except subprocess.TimeoutExpired:
            pytest.fail(f"PS did not finish:\n{(logs / 'ps.log').read_text()[-3000:]}")
        assert rc == 0, (logs / "ps.log").read_text()[-3000:]
        assert (work / "ps" / "final_model.safetensors").is_file()
        assert "(plain TCP, no TLS)" in (logs / "broker.log").read_text()
    finally:  # the PS and sites together, then the broker (Ctrl-C: it stops its Mosquitto)
        stop_processes([(proc, signal.SIGTERM) for name, proc in procs.items() if name != "broker"], 15)
        stop_processes([(procs["broker"], signal.SIGINT)], 15)
    print(f"wheel build + venv + install: {install_s:.1f} s")
