"""Round time with and without secure aggregation, side by side in one run: the same deployed FedAvg job (a real
Mosquitto, the PS and one `fedmqtt site start` process per site on loopback, bench/job_vs_inprocess.py's
`deployed`) once in the clear and once with `[secure_aggregation] enabled = true`, alternating, on the same
synthetic sites and model.

    python bench/secagg_round.py --sites 10 --rounds 3 --model-mb 4.4 --repeats 1
    python bench/secagg_round.py --before-tree /tmp/old   # also secure aggregation as an older checkout runs it
                                                          # (git archive REV | tar -x -C /tmp/old), in the same rotation

Prints the median round time (report.json's duration_s, round 1 excluded: it includes torch start-up at the
sites) of each, their ratio, the per-site CPU and the test accuracy of both runs; `uptime` with every figure.
Also "after training": per round, from the last site's "trained" log line to the PS's "round closed" (the
exchanges that remain once the slowest site has trained; under load the least noisy view of what secure
aggregation adds), median over rounds 2 on.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from job_vs_inprocess import deployed, model_spec, uptime, write_site_tables  # noqa: E402

STAMP = r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})"


def _stamps(text: str, pattern: str) -> dict[int, list[float]]:
    """Round -> the times (s) of the log lines that match `pattern` (its group 1: the round)."""
    out: dict[int, list[float]] = {}
    for m in re.finditer(STAMP + r".*?" + pattern, text, re.MULTILINE):
        when = datetime.datetime.strptime(m[1], "%Y-%m-%dT%H:%M:%S.%f").timestamp()
        out.setdefault(int(m[2]), []).append(when)
    return out


def after_training(logs: Path) -> list[float]:
    """Per round from 2 on: seconds from the last site's "trained" line to the PS's "round N closed" line."""
    trained: dict[int, list[float]] = {}
    for log in logs.glob("site-*.log"):
        for r, times in _stamps(log.read_text(errors="replace"), r"round (\d+): trained \d+ steps").items():
            trained.setdefault(r, []).extend(times)
    closed = _stamps((logs / "ps.log").read_text(errors="replace"), r"round (\d+) closed")
    return [min(closed[r]) - max(trained[r]) for r in sorted(closed) if r >= 2 and r in trained]


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
                tail = after_training(work / f"{name}-{repeat}" / "logs")
                out["after_training_s"] = statistics.median(tail) if tail else float("nan")
                results[name].append(out)
                print(f"{name:6} repeat {repeat}: rounds {[round(r, 2) for r in out['round_s']]} s, median "
                      f"(after round 1) {out['median_round_s']:.2f} s, after training {out['after_training_s']:.2f} s, "
                      f"wall {out['wall_s']:.1f} s, site CPU "
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
    for name, _, _ in variants:
        tail = statistics.median(r["after_training_s"] for r in results[name])
        print(f"{name}: median time from the last site's training to the round's close {tail:.2f} s")
    if "before" in results:
        before = statistics.median(r["median_round_s"] for r in results["before"])
        print(f"secure aggregation as {args.before_tree} runs it: median round {before:.2f} s, ratio "
              f"{before / clear:.2f}x")


if __name__ == "__main__":
    main()
