"""Round time of DP-FedAvg with its noise added by the sites under secure aggregation (`distributed_dp =
"skellam"`) against DP-FedAvg in the clear (the PS clips and adds the noise), side by side in one run: the same
deployed job (a real Mosquitto, the PS and one `fedmqtt site start` process per site on loopback,
bench/job_vs_inprocess.py's `deployed`), alternating clear, distributed, clear, distributed, ...

    python bench/distributed_dp_round.py --sites 5 --rounds 3 --model-mb 1 --repeats 2

Prints the median round time (report.json's duration_s, round 1 excluded: it includes torch start-up at the
sites) of each, their ratio, the CPU of the sites and the PS, and `uptime` with every figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from job_vs_inprocess import deployed, model_spec, uptime, write_site_tables  # noqa: E402

HYPER = {"clip_norm": 1.0, "noise_multiplier": 1.0}
VARIANTS = {
    "clear": {"algorithm": "dp-fedavg", "hyper": HYPER},
    "distributed": {"algorithm": "dp-fedavg", "hyper": HYPER,
                    "secure_aggregation": {"enabled": True, "ring_bits": 32, "fraction_bits": 16, "clip": 8.0,
                                           "distributed_dp": "skellam"}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-mb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = model_spec(args.model_mb)
    with tempfile.TemporaryDirectory(prefix="fedmqtt-ddp-bench-") as tmp:
        work = Path(tmp)
        if os.geteuid() == 0:
            work.chmod(0o711)  # as root the broker runs as `mosquitto`, which must pass through to its files
        tables = write_site_tables(work / "data", args.sites)
        results: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for repeat in range(args.repeats):
            for name, extra in VARIANTS.items():
                out = deployed(work / f"{name}-{repeat}", tables, model, args.rounds, ps_extra=extra)
                rounds = out["round_s"][1:] or out["round_s"]
                results[name].append(statistics.median(rounds))
                print(f"{name:11} repeat {repeat}: rounds {[round(r, 2) for r in out['round_s']]} s, median (after "
                      f"round 1) {results[name][-1]:.2f} s, site CPU {out['usage']['site_cpu_s']:.1f} s, PS CPU "
                      f"{out['usage']['ps_cpu_s']:.1f} s | {uptime()}", flush=True)
    clear, dist = (statistics.median(results[n]) for n in VARIANTS)
    print(f"\n{args.sites} sites, model {args.model_mb} MB, {args.rounds} rounds: median round {clear:.2f} s for "
          f"DP-FedAvg in the clear, {dist:.2f} s with distributed DP under secure aggregation: ratio "
          f"{dist / clear:.2f}x | {uptime()}")


if __name__ == "__main__":
    main()
