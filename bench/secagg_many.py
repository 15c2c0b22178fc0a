"""Many sites over MQTT with and without secure aggregation, side by side in one run: round time and each site's
bytes on the wire.

The same federation as bench/many_sites.py (real Mosquitto, every site a real agent with its own connection and
credentials, several agents per process: site_agent/multi.py, the bundled heart-disease hospitals, the small
MLP), run alternately in the clear and with `[secure_aggregation] enabled = true`, `--repeats` times each.

    python bench/secagg_many.py --sites 100 --rounds 3 --processes 4 --repeats 2

Prints per run the round times and, from each agent's own count at exit (SiteAgent.close), the bytes a site sent
and received over MQTT (median and maximum over the sites, per round); then the medians of the two variants,
their ratios, and `uptime` with every line. Round 1 is left out of the round time (torch start-up at the sites).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from many_sites import write_configs  # noqa: E402

from broker.config import free_port  # noqa: E402
from broker.federation import init_federation  # noqa: E402
from broker.process import BrokerProcess  # noqa: E402
from fedmqtt.config_io import dump_toml  # noqa: E402

SECURE = {"enabled": True, "ring_bits": 32, "fraction_bits": 16, "clip": 8.0}
TRAFFIC = re.compile(r"site (\S+): MQTT traffic: (\d+) bytes sent, (\d+) bytes received")


def uptime() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(work: Path, args: argparse.Namespace, *, secure: bool) -> dict:
    site_ids = [f"site-{i:03d}" for i in range(args.sites)]
    layout = init_federation(work / "federation", run_id="many", site_ids=site_ids, port=free_port(), force=True)
    config = argparse.Namespace(rounds=args.rounds, selection="all", fraction=None, gamma_th=0.3, model_mb=None,
                                upload_turns=2)
    ps_path, site_paths = write_configs(work, layout, config)
    if secure:
        ps = tomllib.loads(ps_path.read_text())
        ps_path.write_text(dump_toml({**ps, "secure_aggregation": SECURE}))
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    started = time.monotonic()
    with BrokerProcess.start(layout.conf_path, port=layout.port):
        procs = []
        for k in range(args.processes):
            chunk = [str(p) for p in site_paths[k :: args.processes]]
            with open(logs / f"sites-{k}.log", "wb") as fh:
                procs.append(subprocess.Popen([sys.executable, "-m", "site_agent.multi", *chunk], stdout=fh,
                                              stderr=fh))
        with open(logs / "ps.log", "wb") as fh:
            ps_proc = subprocess.Popen([sys.executable, "-m", "fedmqtt", "ps", "start", "--config", str(ps_path)],
                                       stdout=fh, stderr=fh)
        try:
            while ps_proc.poll() is None:
                failed = [k for k, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    raise SystemExit(f"site process {failed[0]} failed; see {logs / f'sites-{failed[0]}.log'}")
                time.sleep(0.2)
            for p in procs:  # they exit by themselves once the PS is done; each agent logs its traffic on the way
                p.wait(120)
        finally:
            for p in [ps_proc, *procs]:
                if p.poll() is None:
                    p.terminate()
                    p.wait(30)
    if ps_proc.returncode != 0:
        raise SystemExit(f"PS failed ({ps_proc.returncode}); see {logs / 'ps.log'}")
    report = json.loads((work / "ps" / "report.json").read_text())
    traffic = {m[1]: (int(m[2]), int(m[3])) for k in range(args.processes)
               for m in TRAFFIC.finditer((logs / f"sites-{k}.log").read_text(errors="replace"))}
    if set(traffic) != set(site_ids):
        raise SystemExit(f"traffic of {len(traffic)} of {len(site_ids)} sites in the logs under {logs}")
    rounds = [r["duration_s"] for r in report["rounds"]]
    return {"round_s": rounds, "median_round_s": statistics.median(rounds[1:] or rounds),
            "sent": [s for s, _ in traffic.values()], "received": [r for _, r in traffic.values()],
            "ps_sent": report["traffic"]["bytes_sent"], "ps_received": report["traffic"]["bytes_received"],
            "included": [len(r.get("secure", {}).get("included", r["sites"])) for r in report["rounds"]],
            "wall_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=4, help="site processes (agents are spread over them)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", type=Path, default=None, help="work folder to keep (logs, reports)")
    parser.add_argument("--only", choices=["clear", "secure"], default=None, help="run one variant only")
    args = parser.parse_args()
    names = [args.only] if args.only else ["clear", "secure"]
    results: dict[str, list[dict]] = {name: [] for name in names}
    # A run's work folder is world-traversable for the broker (as root it runs as `mosquitto`).
    with tempfile.TemporaryDirectory(prefix="fedmqtt-secagg-many-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o711)
        for repeat in range(args.repeats):
            for name in names:
                out = run(root / f"{name}-{repeat}", args, secure=name == "secure")
                results[name].append(out)
                per_round = args.rounds + 1  # the rounds and the final evaluation each bring the model
                print(f"{name:6} repeat {repeat}: rounds {[round(r, 2) for r in out['round_s']]} s, median (after "
                      f"round 1) {out['median_round_s']:.2f} s, sites in each sum {out['included']}; per site "
                      f"sent median {statistics.median(out['sent']) / 1e3:.1f} kB (max "
                      f"{max(out['sent']) / 1e3:.1f}), received median {statistics.median(out['received']) / 1e3:.1f}"
                      f" kB (max {max(out['received']) / 1e3:.1f}) over {args.rounds} rounds and the final "
                      f"evaluation ({per_round} models); PS sent {out['ps_sent'] / 1e6:.1f} MB, received "
                      f"{out['ps_received'] / 1e6:.1f} MB; wall {out['wall_s']:.0f} s | {uptime()}", flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(statistics.median(r[key]) if isinstance(r[key], list) else r[key]
                                 for r in results[name])

    if len(names) < 2:
        return
    print(f"\n{args.sites} sites in {args.processes} processes, {args.rounds} rounds, {args.repeats} repeat(s):")
    for key, what in (("median_round_s", "round time (s)"), ("sent", "bytes a site sent"),
                      ("received", "bytes a site received")):
        clear, secure = med("clear", key), med("secure", key)
        print(f"  {what:22}: clear {clear:,.2f}, secure {secure:,.2f}, ratio {secure / clear:.2f}x")
    extra_sent = (med("secure", "sent") - med("clear", "sent")) / args.rounds
    extra_received = (med("secure", "received") - med("clear", "received")) / args.rounds
    print(f"  secure aggregation's extra bytes per site and round: sent {extra_sent / 1e3:.1f} kB, received "
          f"{extra_received / 1e3:.1f} kB | {uptime()}")


if __name__ == "__main__":
    main()
