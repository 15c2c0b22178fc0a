"""What a live dashboard costs: the same 4-site, 10-round FedAvg run (e2e harness, every role its own process),
alternating without and with `fedmqtt dashboard --federation` and one SSE reader (curl on /events).

Per run it prints the broker's and the PS's CPU seconds, and with a dashboard: the dashboard process's own CPU
seconds, the messages the broker delivered to it (its subscription's extra deliveries) per round, and the bytes
it streamed to the reader. CPU is utime+stime from /proc/<pid>/stat, from `ps start` until the PS exits.
Run from the repository root: `.venv/bin/python bench/dashboard_load.py [--pairs 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, "tests/e2e")
from harness import CliFederation  # noqa: E402

from broker.config import free_port  # noqa: E402

ROUNDS = 10


def cpu_s(pid: int) -> float:
    """utime + stime of one process (its own threads included, children not)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broker_pid(conf: Path) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"mosquitto") and str(conf).encode() in argv:
                return int(entry.name)
    raise RuntimeError(f"no mosquitto running {conf}")


def one_run(with_dashboard: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        fed = CliFederation(Path(tmp), run_id="load", rounds=ROUNDS)
        fed.start_broker()
        broker = broker_pid(fed.layout.conf_path)
        dash = reader = None
        stream = Path(tmp) / "events.txt"
        try:
            if with_dashboard:
                port = free_port()
                dash = subprocess.Popen([sys.executable, "-m", "fedmqtt", "dashboard", "--federation",
                                         str(fed.layout.fed_dir), "--port", str(port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(3)
                with open(stream, "wb") as out:
                    reader = subprocess.Popen(["curl", "-sN", f"http://127.0.0.1:{port}/events"], stdout=out)
                time.sleep(1)
            t0, b0 = time.time(), cpu_s(broker)
            d0 = cpu_s(dash.pid) if dash else 0.0
            fed.start_ps()
            ps = fed.procs["ps"].pid
            for site in fed.sites:
                fed.start_site(site)
            p_cpu = 0.0
            while fed.procs["ps"].poll() is None:  # sample the PS until it exits (its /proc entry goes then)
                try:
                    p_cpu = cpu_s(ps)
                except (OSError, IndexError):
                    break
                time.sleep(0.2)
            fed.wait_ps_done(600)
            result = {"run_s": time.time() - t0, "broker_cpu_s": cpu_s(broker) - b0, "ps_cpu_s": p_cpu}
            if dash:
                time.sleep(1.5)  # the last ps/status and metrics reach the dashboard and its stream
                result["dashboard_cpu_s"] = cpu_s(dash.pid) - d0
                state = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=10).read())
                result["messages_per_round"] = state["runs"][0]["messages"] / ROUNDS
                result["sse_kib"] = stream.stat().st_size / 1024
            return result
        finally:
            for proc in (reader, dash):
                if proc is not None:
                    proc.terminate()
                    proc.wait(10)
            fed.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="runs without and with a dashboard, alternating")
    args = parser.parse_args()
    for _ in range(args.pairs):
        for with_dashboard in (False, True):
            r = one_run(with_dashboard)
            extra = (f", dashboard CPU {r['dashboard_cpu_s']:.2f} s, {r['messages_per_round']:.1f} messages/round "
                     f"delivered to it, {r['sse_kib']:.0f} KiB streamed") if with_dashboard else ""
            print(f"dashboard={with_dashboard}: run {r['run_s']:.1f} s, broker CPU {r['broker_cpu_s']:.2f} s, "
                  f"PS CPU {r['ps_cpu_s']:.2f} s{extra}", flush=True)


if __name__ == "__main__":
    main()
