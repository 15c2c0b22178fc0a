"""The same FedAvg job deployed over MQTT and as one plain process: wall time, ratio, final accuracies.

(a) deployed: a real Mosquitto (`fedmqtt broker start`), the PS (`fedmqtt ps start`) and one `fedmqtt site
start` process per site, all on loopback, exactly as a user runs them; timed from launching the PS and the
sites until the PS exits with its report written (the broker and the federation's credentials are set up
before the clock starts: an operator does that once).
(a') deployed with one launcher (`--launcher`): the same, but all sites from one `fedmqtt site start --config A
--config B ...`, which imports once and forks one site process per config (site_agent/launcher.py), as a
researcher runs a local federation on one host. Its CPU per site is the launcher's and its children's / N.
(b) in process: one `python` process that builds the same sites' data, starts from the same initial weights
and, round after round, runs each site's training with the agent's own Trainer (the same validation, seeds
and local loop, torch threads = 1 like each site) and averages with FedAvg weights n_samples; it ends with
the same final evaluation. Timed from launching that process until it exits, so both sides pay Python and
torch start-up. The trees' packages are compiled to bytecode first, as an install does.

Data: N synthetic sites of 2,000 rows x 64 numeric features (a logistic ground truth with a per-site shift),
written as CSV tables. Model: an MLP 64 -> H -> H -> 1 with H chosen for the requested size.

    python bench/job_vs_inprocess.py --sites 10 --rounds 5 --model-mb 4.4 16 --repeats 1 [--launcher]

Runs alternate (deployed, in process, [launcher,] deployed, ...) so that both see the same machine load; `uptime` is
printed with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROWS, FEATURES, SEED = 2000, 64, 0
TRAIN = {"epochs": 1, "batch_size": 64, "lr": 0.001, "optimizer": "adam"}


def hidden_width(model_mb: float) -> int:
    """H so that the MLP's float32 weights (64H + H + H*H + H + H + 1 parameters) take about `model_mb` MB."""
    params = model_mb * 1e6 / 4
    return int((-(FEATURES + 3) + math.sqrt((FEATURES + 3) ** 2 + 4 * params)) / 2)


def model_spec(model_mb: float) -> dict:
    width = hidden_width(model_mb)
    return {"name": "mlp", "args": {"in_features": FEATURES, "hidden": [width, width]}}


def write_site_tables(folder: Path, n_sites: int) -> list[Path]:
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    truth = np.random.default_rng(SEED).normal(size=FEATURES) / math.sqrt(FEATURES) * 3
    paths = []
    for i in range(n_sites):
        rng = np.random.default_rng(1000 + i)
        x = rng.normal(loc=rng.normal(scale=0.3, size=FEATURES), size=(ROWS, FEATURES))
        p = 1 / (1 + np.exp(-(x @ truth + rng.normal(scale=0.3))))
        y = (rng.random(ROWS) < p).astype(int)
        path = folder / f"site-{i:02d}.csv"
        header = ",".join([*(f"f{j:02d}" for j in range(FEATURES)), "label"])
        np.savetxt(path, np.column_stack([x, y]), delimiter=",", header=header, comments="",
                   fmt=["%.6f"] * FEATURES + ["%d"])
        paths.append(path)
    return paths


def data_spec(path: Path, index: int) -> dict:
    spec = path.with_name("features.json")
    if not spec.exists():
        spec.write_text(json.dumps({"label": "label", "numeric": [f"f{j:02d}" for j in range(FEATURES)]}))
    return {"format": "table", "path": str(path), "options": {"spec": str(spec)}, "split_seed": index}


# -- (b) the same job in one process -----------------------------------------------------------------------
def run_in_process(config: dict) -> dict:
    """The job's training and evaluation without any transport (called in a fresh process)."""
    started = time.perf_counter()
    import numpy as np
    import torch

    from fedmqtt.data.registry import load_site_data
    from fedmqtt.data.spec import DataSpec
    from fedmqtt.training.weights import initial_arrays
    from fedmqtt.transport.heap import tune_heap
    from schemas.messages import ModelSpec, TrainSettings
    from site_agent.trainer import Trainer

    tune_heap()  # what every `fedmqtt` process does first: the same heap settings as the sites'
    torch.set_num_threads(1)  # what every site process uses (site config threads = 1)
    spec = ModelSpec.model_validate(config["model"])
    settings = TrainSettings.model_validate({**config["train"], "seed": SEED})
    trainers = {site: Trainer(site, load_site_data(DataSpec.model_validate(data)), device="cpu")
                for site, data in config["sites"].items()}
    weights = initial_arrays(spec.name, dict(spec.args), SEED)
    round_s = []
    for round_no in range(1, config["rounds"] + 1):
        t0 = time.perf_counter()
        results = [t.train(spec, weights, settings, round_no) for t in trainers.values()]
        total = sum(r.n_samples for r in results)
        weights = {name: sum(r.weights[name].astype(np.float64) * (r.n_samples / total) for r in results)
                   .astype(np.float32) for name in weights}
        round_s.append(time.perf_counter() - t0)
    correct = count = 0
    for trainer in trainers.values():
        metrics, counts, _ = trainer.evaluate(spec, weights, ("val", "test"))
        correct += metrics["test"]["accuracy"] * counts["test"]
        count += counts["test"]
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"test_accuracy": correct / count, "round_s": round_s, "inner_s": time.perf_counter() - started,
            "cpu_s": ru.ru_utime + ru.ru_stime, "hwm_mib": ru.ru_maxrss / 1024}


def in_process(work: Path, config: dict) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    path = work / "inprocess.json"
    path.write_text(json.dumps(config))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, __file__, "--inner", str(path)], capture_output=True, text=True)
    wall = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(f"in-process run failed:\n{out.stderr[-3000:]}")
    return {"wall_s": wall, **json.loads(out.stdout.strip().splitlines()[-1])}


# -- (a) the deployed job ----------------------------------------------------------------------------------
def deployed(work: Path, tables: list[Path], model: dict, rounds: int, tree: Path | None = None,
             ps_extra: dict | None = None, launcher: bool = False) -> dict:
    """`tree`: run the deployed processes from another checkout (e.g. `git archive` of an older commit), for a
    before/after comparison in one run. `ps_extra`: more PS config keys (e.g. secure_aggregation). `launcher`:
    every site from one `site start` with several --config (forked site processes) instead of one each."""
    from broker.config import free_port
    from fedmqtt.config_io import dump_toml
    from fedmqtt.transport import topics
    from fedmqtt.transport.channel import Channel
    from fedmqtt.transport.mqtt import MqttTransport

    site_ids = [f"site-{i:02d}" for i in range(len(tables))]
    fed = work / "federation"
    init = ["broker", "init", "--dir", str(fed), "--run-id", "bench", "--port", str(free_port())]
    subprocess.run([sys.executable, "-m", "fedmqtt", *init, *(a for s in site_ids for a in ("--site", s))],
                   check=True, capture_output=True)
    from broker.federation import load_federation

    layout = load_federation(fed)
    ps = {"run_id": "bench", "rounds": rounds, "sites": site_ids, "quorum": 1, "round_timeout_s": 600.0,
          "seed": SEED, "out_dir": str(work / "ps"), "credentials": str(layout.credentials["ps"]),
          "model": model, "train": TRAIN, **(ps_extra or {})}
    (work / "ps.toml").write_text(dump_toml(ps))
    for i, site in enumerate(site_ids):
        cfg = {"site_id": site, "run_id": "bench", "credentials": str(layout.credentials[site]),
               "state_dir": str(work / "state" / site), "device": "cpu", "threads": 1,
               "data": data_spec(tables[i], i)}
        (work / f"{site}.toml").write_text(dump_toml(cfg))
    logs = work / "logs"
    logs.mkdir(exist_ok=True)

    env = {**os.environ, **({"PYTHONPATH": str(tree)} if tree else {})}

    def spawn(name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "ab") as fh:
            return subprocess.Popen([sys.executable, "-m", "fedmqtt", *args], stdout=fh, stderr=subprocess.STDOUT,
                                    cwd=tree, env=env)

    broker = spawn("broker", "broker", "start", "--dir", str(fed))
    _wait_for_port(layout.port)
    observer = MqttTransport(layout.settings("observer"), client_id="bench-observer")
    try:
        observer.connect(timeout_s=30)
        observer.subscribe([topics.site_status_topic("bench", s) for s in site_ids])
        watch = Channel(observer, run_id="bench", identity=layout.identity("observer"))
        t0 = time.monotonic()
        procs = {"ps": spawn("ps", "ps", "start", "--config", str(work / "ps.toml"))}
        if launcher:
            configs = [a for site in site_ids for a in ("--config", str(work / f"{site}.toml"))]
            procs["sites"] = spawn("sites", "site", "start", *configs, "--exit-when-done")
        for site in [] if launcher else site_ids:
            procs[site] = spawn(site, "site", "start", "--config", str(work / f"{site}.toml"), "--exit-when-done")
        online: dict[str, float] = {}
        usage = Usage({**procs, "broker": broker})
        while procs["ps"].poll() is None:
            usage.sample()
            inbound = watch.receive(0.1)
            if inbound is not None and getattr(inbound.message, "state", "") == "online":
                online.setdefault(inbound.message.sender, time.monotonic() - t0)
            dead = [n for n, p in procs.items() if p.poll() not in (None, 0)]
            if dead:
                raise SystemExit(f"{dead[0]} failed; see {logs / (dead[0] + '.log')}")
        wall = time.monotonic() - t0
        end = time.monotonic() + 30
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < end:
            usage.sample()
            time.sleep(0.05)
        for p in procs.values():
            p.wait(1)
    finally:
        observer.close()
        broker.terminate()
        broker.wait(10)
    if procs["ps"].returncode != 0:
        raise SystemExit(f"PS failed; see {logs / 'ps.log'}")
    report = json.loads((work / "ps" / "report.json").read_text())
    correct = count = 0
    for site in report["final"]["per_site"].values():
        correct += site["metrics"]["test"]["accuracy"] * site["n_samples"]["test"]
        count += site["n_samples"]["test"]
    return {"wall_s": wall, "test_accuracy": correct / count, "round_s": [r["duration_s"] for r in report["rounds"]],
            "all_online_s": max(online.values()) if len(online) == len(site_ids) else None,
            "usage": usage.summary(len(site_ids))}


class Usage:
    """CPU seconds (user + system) and peak RSS of each process and its children, read from /proc every ~0.1 s
    until it exits (the last reading before exit, so up to one interval of CPU is missed)."""

    def __init__(self, procs: dict[str, subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.seen: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in procs}

    def sample(self) -> None:
        # Here, not at the top: the in-process run loads this module too and must not pay for many_sites.
        from many_sites import cpu_seconds, peak_rss_mb  # bench/ is this script's folder

        for name, p in self.procs.items():
            for pid in (p.pid, *_children(p.pid)):  # `fedmqtt broker start` runs mosquitto as its child
                cpu, hwm = cpu_seconds(pid), peak_rss_mb(pid)
                if cpu is not None:  # both only grow; an exiting process shows no VmHWM any more
                    was_cpu, was_hwm = self.seen[name].get(pid, (0.0, 0.0))
                    self.seen[name][pid] = (max(was_cpu, cpu), max(was_hwm, hwm or 0.0))

    @property
    def cpu(self) -> dict[str, float]:
        return {name: sum(r[0] for r in pids.values()) for name, pids in self.seen.items() if pids}

    @property
    def hwm_mib(self) -> dict[str, float]:
        return {name: max(r[1] for r in pids.values()) for name, pids in self.seen.items() if pids}

    def summary(self, n_sites: int) -> dict[str, float]:
        """Per site: one process each, or the launcher ("sites": the parent and its forked sites) over N."""
        cpu = self.cpu
        sites = [n for n in cpu if n.startswith("site-") or n == "sites"]
        return {"site_cpu_s": sum(cpu[n] for n in sites) / max(1, n_sites),
                "site_hwm_mib": max((max(r[1] for r in self.seen[n].values()) for n in sites), default=0.0),
                "ps_cpu_s": cpu.get("ps", 0.0), "broker_cpu_s": cpu.get("broker", 0.0),
                "total_cpu_s": sum(cpu.values())}


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _usage_line(u: dict[str, float]) -> str:
    return (f"CPU s: {u['total_cpu_s']:.1f} in all, {u['site_cpu_s']:.2f} per site (peak RSS "
            f"{u['site_hwm_mib']:.0f} MiB), PS {u['ps_cpu_s']:.2f}, broker {u['broker_cpu_s']:.2f}")


def _wait_for_port(port: int, timeout_s: float = 15.0) -> None:
    import socket

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"the broker did not open port {port}")


def uptime() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model-mb", type=float, nargs="+", default=[4.4, 16.0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="also run the deployed job from this checkout (before/after, alternating)")
    ap.add_argument("--launcher", action="store_true",
                    help="also run the deployed job with every site from one launcher (site start --config x N)")
    ap.add_argument("--inner", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner is not None:
        print(json.dumps(run_in_process(json.loads(args.inner.read_text()))))
        return
    for tree in {REPO, *([args.baseline_tree.resolve()] if args.baseline_tree else [])}:
        # As `pip install` does for an installed site: else, with PYTHONDONTWRITEBYTECODE=1, every process
        # compiles the package from source (about 0.1 CPU s each), which the in-process side pays once.
        subprocess.run([sys.executable, "-m", "compileall", "-q", "fedmqtt", "schemas", "site_agent", "ps_daemon",
                        "broker"], cwd=tree, check=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="fedmqtt-job-"))
    tables = write_site_tables(work / "data", args.sites)
    print(f"N={args.sites} sites x {ROWS} rows x {FEATURES} features, {args.rounds} rounds, train {TRAIN}, "
          f"{os.cpu_count()} CPUs; work dir {work}")
    for mb in args.model_mb:
        model = model_spec(mb)
        config = {"model": model, "train": TRAIN, "rounds": args.rounds,
                  "sites": {f"site-{i:02d}": data_spec(t, i) for i, t in enumerate(tables)}}
        for rep in range(args.repeats):
            load_before = uptime()
            mqtt = deployed(work / f"mqtt-{mb}-{rep}", tables, model, args.rounds)
            load_mid = uptime()
            local = in_process(work / f"local-{mb}-{rep}", config)
            print(f"{mb} MB (hidden {model['args']['hidden']}), repeat {rep}: deployed {mqtt['wall_s']:.1f} s, "
                  f"in process {local['wall_s']:.1f} s, ratio {mqtt['wall_s'] / local['wall_s']:.2f}; "
                  f"test accuracy deployed {mqtt['test_accuracy']:.4f} / in process {local['test_accuracy']:.4f}; "
                  f"load {load_before} / {load_mid} / {uptime()}")
            if args.launcher:
                forked = deployed(work / f"launcher-{mb}-{rep}", tables, model, args.rounds, launcher=True)
                print(f"  launcher (one `site start`, {args.sites} forked sites): deployed {forked['wall_s']:.1f} s "
                      f"(ratio {forked['wall_s'] / local['wall_s']:.2f}), "
                      f"all online {forked['all_online_s'] or float('nan'):.1f} s, "
                      f"rounds {', '.join(f'{s:.2f}' for s in forked['round_s'])}, test accuracy "
                      f"{forked['test_accuracy']:.4f}; {_usage_line(forked['usage'])}; load {uptime()}")
            if args.baseline_tree is not None:
                old = deployed(work / f"old-{mb}-{rep}", tables, model, args.rounds, tree=args.baseline_tree)
                print(f"  baseline tree {args.baseline_tree}: deployed {old['wall_s']:.1f} s (ratio "
                      f"{old['wall_s'] / local['wall_s']:.2f}), "
                      f"all online {old['all_online_s'] or float('nan'):.1f} s, "
                      f"rounds {', '.join(f'{s:.2f}' for s in old['round_s'])}, test accuracy "
                      f"{old['test_accuracy']:.4f}; {_usage_line(old['usage'])}; load {uptime()}")
            print(f"  rounds deployed (PS's duration_s): {', '.join(f'{s:.2f}' for s in mqtt['round_s'])}; "
                  f"in process: {', '.join(f'{s:.2f}' for s in local['round_s'])}; in-process start-up + final "
                  f"evaluation {local['wall_s'] - sum(local['round_s']):.1f} s; all {args.sites} sites online "
                  f"{mqtt['all_online_s']:.1f} s after launch" if mqtt["all_online_s"] is not None else
                  "  (not every site was seen online)")
            print(f"  deployed {_usage_line(mqtt['usage'])}; in process CPU s: {local['cpu_s']:.1f} "
                  f"(peak RSS {local['hwm_mib']:.0f} MiB)")


if __name__ == "__main__":
    main()
