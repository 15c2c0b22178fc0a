"""Round time with and without secure aggregation, side by side in one run: the same deployed FedAvg job (a real
Mosquitto, the PS and one `fedmqtt site start` process per site on loopback, bench/job_vs_inprocess.py's
`deployed`) once in the clear and once with `[secure_aggregation] enabled = true`, alternating, on the same
synthetic sites and model.

    python bench/secagg_round.py --sites 10 --rounds 3 --model-mb 4.4 --repeats 1
    python bench/secagg_round.py --before-tree /tmp/old   # also secure aggregation as an older checkout runs it
                                                          # (git archive REV | tar -x -C /tmp/old), in the same rotation

Prints the median round time (report.json's duration_s, round 1 excluded: it includes torch start-up at the
sites) of each, their ratio, the per-site CPU and the test accuracy of both runs; `uptime` with every figure.
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

SECURE = {"secure_aggregation": {"enabled": True, "ring_bits": 32, "fraction_bits": 16, "clip": 8.0}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-mb", type=float, default=4.4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--before-tree", type=Path, default=None,
                        help="a checkout whose processes run a third variant, secure aggregation as it was there")
    args = parser.parse_args()
    variants: list[tuple[str, dict | None, Path | None]] = [("clear", None, None), ("secure", SECURE, None)]
    if args.before_tree is not None:
        variants.append(("before", SECURE, args.before_tree.resolve()))
    model = model_spec(args.model_mb)
    with tempfile.TemporaryDirectory(prefix="fedmqtt-secagg-bench-") as tmp:
        work = Path(tmp)
        if os.geteuid() == 0:
            work.chmod(0o711)  # as root the broker runs as `mosquitto`, which must pass through to its files
        tables = write_site_tables(work / "data", args.sites)
        results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
        for repeat in range(args.repeats):
            for name, extra, tree in variants:
                out = deployed(work / f"{name}-{repeat}", tables, model, args.rounds, tree=tree, ps_extra=extra)
                rounds = out["round_s"][1:] or out["round_s"]
                out["median_round_s"] = statistics.median(rounds)
                results[name].append(out)
                print(f"{name:6} repeat {repeat}: rounds {[round(r, 2) for r in out['round_s']]} s, median "
                      f"(after round 1) {out['median_round_s']:.2f} s, wall {out['wall_s']:.1f} s, site CPU "
                      f"{out['usage']['site_cpu_s']:.1f} s, PS CPU {out['usage']['ps_cpu_s']:.1f} s, test accuracy "
                      f"{out['test_accuracy']:.3f} | {uptime()}", flush=True)
    clear = statistics.median(r["median_round_s"] for r in results["clear"])
    secure = statistics.median(r["median_round_s"] for r in results["secure"])
    print(f"\n{args.sites} sites, model {args.model_mb} MB, {args.rounds} rounds: median round {clear:.2f} s in the "
          f"clear, {secure:.2f} s under secure aggregation: ratio {secure / clear:.2f}x")
    for repeat in range(args.repeats):
        base = results["clear"][repeat]["median_round_s"]
        ratios = ", ".join(f"{name} / clear {results[name][repeat]['median_round_s'] / base:.2f}x"
                           for name, _, _ in variants[1:])
        print(f"  repeat {repeat}: {ratios}")
    if "before" in results:
        before = statistics.median(r["median_round_s"] for r in results["before"])
        print(f"secure aggregation as {args.before_tree} runs it: median round {before:.2f} s, ratio "
              f"{before / clear:.2f}x")


if __name__ == "__main__":
    main()
