"""`fedmqtt demo`: a real federation on this machine (broker, PS and four sites as separate processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tqdm import tqdm

from broker.config import free_port
from broker.federation import FederationLayout, init_federation
from broker.process import BrokerProcess
from fedmqtt.config_io import dump_toml
from fedmqtt.data.heart_disease import SITES, bundled_path
from fedmqtt.errors import FedMqttError
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.mqtt import MqttTransport
from ps_daemon.config import SGD_ONLY, load_daemon_config
from ps_daemon.report import final_table, render_table
from schemas import messages as m

RUN_ID = "heart-demo"
# Chosen on the pooled baseline (see README): a small MLP, Adam, one local epoch per round.
DEMO_MODEL = {"name": "mlp", "args": {"in_features": 15, "hidden": [32, 32], "norm": "none", "dropout": 0.3}}
DEMO_TRAIN = {"epochs": 2, "batch_size": 32, "lr": 0.001, "optimizer": "adam"}


def write_role_configs(layout: FederationLayout, work: Path, *, rounds: int, seed: int,
                       round_timeout_s: float = 120.0, train: dict[str, Any] | None = None,
                       algorithm: str = "fedavg", hyper: dict[str, float] | None = None,
                       model: dict[str, Any] | None = None,
                       share_label_histogram: bool = False,
                       ps_extra: dict[str, Any] | None = None) -> tuple[Path, dict[str, Path]]:
    """The PS config and one config per site, as a deployment would have them."""
    ps = {
        "run_id": layout.run_id, "algorithm": algorithm, "hyper": hyper or {}, "rounds": rounds,
        "sites": list(layout.site_ids),
        "quorum": 1, "round_timeout_s": round_timeout_s, "seed": seed, "out_dir": str(work / "ps"),
        "credentials": str(layout.credentials["ps"]),
        "model": model or DEMO_MODEL, "train": train or DEMO_TRAIN, **(ps_extra or {}),
    }
    ps_path = work / "ps.toml"
    ps_path.write_text(dump_toml(ps))
    site_paths = {}
    for site in layout.site_ids:
        cfg = {"site_id": site, "run_id": layout.run_id, "credentials": str(layout.credentials[site]),
               "state_dir": str(work / "state" / site), "device": "auto", "threads": 1,
               "share_label_histogram": share_label_histogram,
               "data": {"format": "heart_disease", "path": str(bundled_path(site))}}
        site_paths[site] = work / "sites" / f"{site}.toml"
        site_paths[site].parent.mkdir(parents=True, exist_ok=True)
        site_paths[site].write_text(dump_toml(cfg))
    return ps_path, site_paths


def spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """A role as its own process (`python -m fedmqtt ...`), its output in a log file."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "fedmqtt", *args], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # Ctrl-C reaches only us; we stop children in order


def stop_all(procs: dict[str, subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGTERM every role at once (each says 'offline' and disconnects), then reap; SIGKILL stragglers."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout_s
    for proc in procs.values():
        try:
            proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM gets the same orderly teardown as Ctrl-C


def run_demo(*, out: Path | None, rounds: int, seed: int, timeout_s: float, algorithm: str = "fedavg",
             progress: bool = True, secure_aggregation: bool = False) -> dict[str, Any]:
    """Run the demo federation; every process it started is stopped on return, error or Ctrl-C."""
    started = time.time()
    signal.signal(signal.SIGTERM, _interrupt)
    with ExitStack() as stack:
        work = (Path(out).resolve() if out
                else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedmqtt-demo-"))))
        work.mkdir(parents=True, exist_ok=True)
        if not out and os.geteuid() == 0:
            # Run as root, the broker runs as the `mosquitto` user (broker/config.py), which must pass through
            # this 0700 folder to its files; passing through lists and reads nothing.
            work.chmod(0o711)
        layout = init_federation(work / "federation", run_id=RUN_ID, site_ids=list(SITES), port=free_port(), force=True)
        train = {**DEMO_TRAIN, "optimizer": "sgd", "lr": 0.05} if algorithm in SGD_ONLY else DEMO_TRAIN
        secure = {"secure_aggregation": {"enabled": True}} if secure_aggregation else None
        ps_cfg, site_cfgs = write_role_configs(layout, work, rounds=rounds, seed=seed, algorithm=algorithm,
                                               train=train, share_label_histogram=algorithm == "feddkw",
                                               ps_extra=secure)
        load_daemon_config(ps_cfg)  # a bad algorithm or setting fails here, before any process starts
        print(f"fedmqtt demo: {algorithm}, {rounds} rounds, sites {', '.join(SITES)} (UCI heart disease, CC BY 4.0)"
              + (", secure aggregation (the PS sees only sums)" if secure_aggregation else ""))
        broker = stack.enter_context(BrokerProcess.start(layout.conf_path, port=layout.port, host=layout.host))
        print(f"  broker      mosquitto pid {broker.pid} on {layout.host}:{layout.port}")
        procs = {"ps": spawn(["ps", "start", "--config", str(ps_cfg)], work / "logs" / "ps.log")}
        for site, path in site_cfgs.items():
            procs[site] = spawn(["site", "start", "--config", str(path)], work / "logs" / f"{site}.log")
        stack.callback(stop_all, procs)  # before the broker stops (ExitStack unwinds in reverse)
        for name, proc in procs.items():
            print(f"  {name:<11} pid {proc.pid}")
        _follow(layout, rounds=rounds, procs=procs, deadline=started + timeout_s, logs=work / "logs",
                progress=progress)
        if procs["ps"].wait(30) != 0:
            raise FedMqttError(f"the PS exited with {procs['ps'].returncode}; see {work / 'logs' / 'ps.log'}")
        report = json.loads((work / "ps" / "report.json").read_text())
        _print_summary(report, work, kept=out is not None, wall_s=time.time() - started)
        return report


def _follow(layout: FederationLayout, *, rounds: int, procs: dict[str, subprocess.Popen[bytes]],
            deadline: float, logs: Path, progress: bool = True) -> None:
    """Watch ps/metrics and ps/status as the observer (what any MQTT client sees) and show progress: a bar,
    or with `progress` off one plain line per closed round and per change of what the PS waits for."""
    transport = MqttTransport(layout.settings("observer"), client_id=f"fedmqtt-demo-{os.getpid()}")
    transport.connect()
    channel = Channel(transport, run_id=layout.run_id, identity=layout.identity("observer"))
    transport.subscribe([topics.ps_metrics_topic(layout.run_id), topics.ps_status_topic(layout.run_id)])
    bar = tqdm(total=rounds, desc="rounds", unit="round", dynamic_ncols=True, disable=not progress)
    said, closed = "", 0  # closed: rounds seen closing (the bar's own count stays 0 when it is off)
    try:
        while True:
            if time.time() > deadline:
                raise FedMqttError(f"demo timed out; logs in {logs}")
            dead = [n for n, p in procs.items() if p.poll() is not None and p.returncode != 0]
            if dead:
                raise FedMqttError(f"{', '.join(dead)} exited early; see {logs}")
            inbound = channel.receive(0.5)
            msg = inbound.message if inbound else None
            if isinstance(msg, m.RoundMetrics) and msg.phase == "train":
                bar.update(max(0, msg.round - closed))
                closed = max(closed, msg.round)
                auroc = msg.mean.get("auroc")
                bar.set_postfix_str(f"val auroc {'n/a' if auroc is None else f'{auroc:.3f}'}")
                if not progress:
                    print(f"  round {msg.round}/{rounds}: mean val auroc {'n/a' if auroc is None else f'{auroc:.3f}'}")
            elif isinstance(msg, m.DaemonStatus) and msg.state == "done":
                return
            elif isinstance(msg, m.DaemonStatus) and (closed == 0 or msg.state == "waiting_for_sites"):
                bar.set_postfix_str(_waiting(msg), refresh=True)  # before round 1: what the PS waits for
                if not progress and _waiting(msg) != said:
                    said = _waiting(msg)
                    print(f"  {said}")
            elif procs["ps"].poll() == 0:
                return
    finally:
        bar.close()
        transport.close()


def _waiting(status: m.DaemonStatus) -> str:
    """The PS's state in a few words: who is online, whom the round still waits for."""
    online = f"{len(status.sites_online)}/{len(status.sites_expected)} sites online"
    if status.state == "waiting_for_sites":
        missing = sorted(set(status.sites_expected) - set(status.sites_online))
        return f"PS waiting for sites ({online}; missing {', '.join(missing) or 'none'})"
    if status.waiting_for:
        return f"{status.state}: waiting for {', '.join(status.waiting_for)} ({online})"
    return f"{status.state} ({online})"


def _print_summary(report: dict[str, Any], work: Path, *, kept: bool, wall_s: float) -> None:
    print()
    print("Final model on each site's held-out test split:")
    print(render_table(final_table(report)))
    best = report.get("best_round")
    if best:
        line = f"best validation round: {best['round']} (mean {best['metric']} {best['score']:.3f})"
        tested = ((report.get("best") or {}).get("mean") or {}).get("test", {})
        if tested.get("auroc") is not None:  # Hwang et al.'s protocol: that round's models on the test splits
            line += f"; its models' mean test AUROC {tested['auroc']:.3f}"
        print(line)
    traffic = report["traffic"]
    print(f"wall time {wall_s:.1f} s; PS sent {traffic['bytes_sent']:,} B, received {traffic['bytes_received']:,} B")
    if kept:
        print(f"report   {work / 'ps' / 'report.json'}  (and report.md)")
        print(f"models   {report['models'].get('final')}  best: {report['models'].get('best')}")
        print(f"logs     {work / 'logs'}")
    else:
        print("(run with --out DIR to keep the report, the final model and the logs)")
