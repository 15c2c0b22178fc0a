"""Many sites against one real Mosquitto: round time and the PS's peak memory against N.

Every site is a real agent with its own MQTT connection and credentials; several run per process
(site_agent.multi) so 100+ fit on a 2-core machine. Data: the bundled heart-disease hospitals,
site i reading hospital i mod 4 (the timing is what matters here, not the accuracy).

    python bench/many_sites.py --sites 100 --rounds 3 --processes 4 [--selection recruited --gamma-th 0.3]
    python bench/many_sites.py --sites 20 --rounds 2 --model-mb 16 --bare   # model size, overhead vs bare paho

`--model-mb M` swaps the small MLP for a wide one of about M MB of float32 weights and makes local work
one SGD step, so the round is mostly communication; `--bare` then moves the same bytes through the same
broker with bare paho clients (bench/bare_paho.py) for the floor to compare the overhead with.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config import free_port  # noqa: E402
from broker.federation import init_federation  # noqa: E402
from broker.process import BrokerProcess  # noqa: E402
from fedmqtt.config_io import dump_toml  # noqa: E402
from fedmqtt.data.heart_disease import SITES, bundled_path  # noqa: E402


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process (from /proc/<pid>/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def model_spec(model_mb: float | None) -> dict:
    """The heart MLP, or one with two hidden layers of width H so that it holds about `model_mb` MB."""
    if not model_mb:
        return {"name": "mlp", "args": {"in_features": 15, "hidden": [32, 32]}}
    params = model_mb * 1e6 / 4
    width = int((-18 + math.sqrt(18 * 18 + 4 * params)) / 2)  # 15H + H + H*H + H + H + 1 params
    return {"name": "mlp", "args": {"in_features": 15, "hidden": [width, width]}}


def model_bytes(spec: dict) -> int:
    from fedmqtt.training.weights import initial_arrays

    return sum(a.nbytes for a in initial_arrays(spec["name"], spec["args"], 0).values())


def bare_paho(work: Path, layout, sites: int, model_mb: float) -> dict:  # noqa: ANN001
    """The floor on a twin of the federation's broker: the same mosquitto.conf limits (packet size, in-flight
    window, queues), but anonymous on its own loopback port. The federation's broker binds each client id to
    its user, so N bare clients cannot share one set of credentials there."""
    conf = layout.conf_path.read_text()
    shared = conf[: conf.index("# federation-specific")] if "# federation-specific" in conf else conf
    shared = shared.replace("allow_anonymous false", "allow_anonymous true").replace("persistence true",
                                                                                     "persistence false")
    port = free_port()
    twin = work / "bare" / "mosquitto.conf"
    twin.parent.mkdir(parents=True, exist_ok=True)
    twin.write_text(f"{shared}\nlistener {port} 127.0.0.1\nlog_dest file {twin.parent / 'mosquitto.log'}\n")
    with BrokerProcess.start(twin, port=port):
        out = subprocess.run([sys.executable, str(Path(__file__).with_name("bare_paho.py")), "--port", str(port),
                              "--prefix", f"fedmqtt/v1/{layout.run_id}/bench", "--sites", str(sites),
                              "--model-mb", str(model_mb)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bare paho failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_configs(work: Path, layout, args) -> tuple[Path, list[Path]]:  # noqa: ANN001
    ps = {"run_id": layout.run_id, "rounds": args.rounds, "sites": list(layout.site_ids), "quorum": 1,
          "round_timeout_s": 600.0, "seed": 0, "out_dir": str(work / "ps"),
          "credentials": str(layout.credentials["ps"]),
          "selection": args.selection, "model": model_spec(args.model_mb), "upload_turns": args.upload_turns,
          "train": {"epochs": 1, "batch_size": 32, "lr": 0.001, "optimizer": "adam"}}
    if args.model_mb:
        ps["train"] = {"epochs": 1, "batch_size": 16, "steps_per_epoch": 1, "lr": 0.001, "optimizer": "sgd"}
    if args.fraction:
        ps["fraction"] = args.fraction
    if args.selection == "recruited":
        ps["recruitment"] = {"gamma_th": args.gamma_th}
    ps_path = work / "ps.toml"
    ps_path.write_text(dump_toml(ps))
    paths = []
    for i, site in enumerate(layout.site_ids):
        cfg = {"site_id": site, "run_id": layout.run_id, "credentials": str(layout.credentials[site]),
               "state_dir": str(work / "state" / site), "device": "cpu", "threads": 1, "share_label_histogram": True,
               "data": {"format": "heart_disease", "path": str(bundled_path(SITES[i % 4])), "split_seed": i}}
        paths.append(work / "sites" / f"{site}.toml")
        paths[-1].parent.mkdir(parents=True, exist_ok=True)
        paths[-1].write_text(dump_toml(cfg))
    return ps_path, paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sites", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--processes", type=int, default=4, help="site processes (agents are spread over them)")
    ap.add_argument("--selection", default="all", choices=["all", "fraction", "recruited"])
    ap.add_argument("--fraction", type=float, default=None)
    ap.add_argument("--gamma-th", type=float, default=0.3)
    ap.add_argument("--work", type=Path, default=None, help="work folder, kept (default: a temporary one, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work folder (logs, reports)")
    ap.add_argument("--model-mb", type=float, default=None, help="model size in MB (default: the small heart MLP)")
    ap.add_argument("--upload-turns", type=int, default=2, help="the PS's upload_turns (large updates at the "
                    "broker at once)")
    ap.add_argument("--bare", action="store_true", help="also time the same bytes through bare paho clients")
    ap.add_argument("--py-spy", action="store_true",
                    help="sample the PS and each site process with py-spy (pip install py-spy); raw stacks in "
                    "<work>/logs (the PS's peak memory and CPU are then py-spy's)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="fedmqtt-many-"))
    site_ids = [f"site-{i:03d}" for i in range(args.sites)]
    started = time.monotonic()
    layout = init_federation(work / "federation", run_id="many", site_ids=site_ids, port=free_port(), force=True)
    ps_path, site_paths = write_configs(work, layout, args)
    (work / "logs").mkdir(exist_ok=True)
    with BrokerProcess.start(layout.conf_path, port=layout.port) as broker:
        procs = []
        for k in range(args.processes):
            chunk = [str(p) for p in site_paths[k :: args.processes]]
            log = open(work / "logs" / f"sites-{k}.log", "wb")
            cmd = [sys.executable, "-m", "site_agent.multi", *chunk]
            if args.py_spy:
                cmd = ["py-spy", "record", "--format", "raw", "-o", str(work / "logs" / f"sites-{k}.pyspy.txt"),
                       "--", *cmd]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=log))
        ps_log = open(work / "logs" / "ps.log", "wb")
        ps_cmd = [sys.executable, "-m", "fedmqtt", "ps", "start", "--config", str(ps_path)]
        if args.py_spy:
            ps_cmd = ["py-spy", "record", "--format", "raw", "-o", str(work / "logs" / "ps.pyspy.txt"), "--", *ps_cmd]
        ps = subprocess.Popen(ps_cmd, stdout=ps_log, stderr=ps_log)
        peak = broker_peak = ps_cpu = broker_cpu = 0.0
        site_peaks = [0.0] * len(procs)
        while ps.poll() is None:
            peak = max(peak, peak_rss_mb(ps.pid) or 0.0)
            broker_peak = max(broker_peak, peak_rss_mb(broker.pid) or 0.0)
            site_peaks = [max(old, peak_rss_mb(p.pid) or 0.0) for old, p in zip(site_peaks, procs, strict=True)]
            ps_cpu, broker_cpu = cpu_seconds(ps.pid) or ps_cpu, cpu_seconds(broker.pid) or broker_cpu
            failed = [k for k, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                ps.terminate()
                raise SystemExit(f"site process {failed[0]} failed; see {work / 'logs' / f'sites-{failed[0]}.log'}")
            time.sleep(0.2)
        for p in procs:
            p.send_signal(signal.SIGINT) if args.py_spy else p.terminate()  # py-spy writes its profile on SIGINT
        for p in procs:
            p.wait(30)
        bare = bare_paho(work, layout, args.sites, args.model_mb) if args.bare and args.model_mb else None
    if ps.returncode != 0:
        raise SystemExit(f"PS failed ({ps.returncode}); see {work / 'logs' / 'ps.log'}")
    report = json.loads((work / "ps" / "report.json").read_text())
    durations = [r["duration_s"] for r in report["rounds"]]
    recruited = report.get("recruitment") or {}
    print(f"sites={args.sites} processes={args.processes} selection={args.selection} rounds={args.rounds}")
    if recruited:
        print(f"recruited {len(recruited['recruited'])} of {args.sites} (gamma_th={args.gamma_th})")
    print("round wall time (s): " + ", ".join(f"{d:.2f}" for d in durations))
    print(f"mean round time {sum(durations) / len(durations):.2f} s; sites per round "
          f"{[len(r['sites']) for r in report['rounds']]}")
    print(f"PS peak RSS {peak:.0f} MB (VmHWM, sampled every 0.2 s)")
    print(f"PS traffic: sent {report['traffic']['bytes_sent']:,} B, received {report['traffic']['bytes_received']:,} B")
    print(f"broker peak RSS {broker_peak:.0f} MB (VmHWM)")
    print(f"CPU seconds over the whole run (start-up and final evaluation included): PS {ps_cpu:.1f}, "
          f"broker {broker_cpu:.1f}, for {args.rounds} rounds")
    spec = model_spec(args.model_mb)
    raw = model_bytes(spec)
    print(f"model {spec['args']['hidden']}: {raw / 1e6:.1f} MB of tensors")
    model_mb = raw / 2**20
    print(f"PS peak / model = {peak / model_mb:.2f}; broker peak / model = {broker_peak / model_mb:.2f}")
    print(f"site process peak RSS (MB, VmHWM): {', '.join(f'{p:.0f}' for p in site_peaks)}")
    if args.model_mb and args.sites == args.processes:  # one agent per process: its peak is one site's
        ps_cfg = tomllib.loads((work / "ps.toml").read_text())
        alone = subprocess.run([sys.executable, str(Path(__file__).with_name("train_alone.py")),
                                json.dumps(ps_cfg["model"]), json.dumps(ps_cfg["train"])],
                               capture_output=True, text=True, check=True)
        alone_mb = json.loads(alone.stdout.strip().splitlines()[-1])["peak_mb"]
        print(f"the same local training alone in one process (bench/train_alone.py): peak {alone_mb:.0f} MB; "
              f"a site's peak beyond it / model = {(max(site_peaks) - alone_mb) / model_mb:.2f}")
    usage = report.get("usage", {}).get("per_round", {})
    overheads = []
    for r in report["rounds"]:
        compute = [u["wall_s"] for u in usage.get(str(r["round"]), {}).values()]
        if compute:
            overheads.append(r["duration_s"] - max(compute))
    if overheads:
        print("communication overhead per round (round wall time - slowest site's training), s: "
              + ", ".join(f"{o:.2f}" for o in overheads))
    answered = sum(len(r["sites"]) for r in report["rounds"])
    received = report["traffic"]["bytes_received"]
    print(f"uplink bytes on the wire / raw update tensor bytes: {received / max(1, answered * raw):.4f} "
          f"({received:,} B for {answered} updates of {raw:,} B; includes statuses and final reports)")
    if bare is not None:
        print(f"bare paho, a twin broker with the same limits, same bytes: fan-out {bare['fan_out_s']:.2f} s "
              f"+ fan-in {bare['fan_in_s']:.2f} s = {bare['total_s']:.2f} s ({bare['mb_per_s']:.0f} MB/s)")
    print(f"total wall time incl. start-up {time.monotonic() - started:.1f} s")
    if args.work is None and not args.keep:
        shutil.rmtree(work, ignore_errors=True)  # a 512 MB run leaves ~8 GB of checkpoints, models and state
    else:
        print(f"work dir {work}")


if __name__ == "__main__":
    main()
