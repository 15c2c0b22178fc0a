"""A site agent's own work per round at 16 MB, beyond training and validation: this tree against another checkout.

The job is `fedmqtt simulate`'s: the PS runner and the site agents in one process over the in-memory broker
(fedmqtt/transport/memory.py), so each agent does exactly what a deployed one does per round (verify the model's
chunks, decode and validate it, check its hash, compose the weights, keep the best-round slot, train and
validate, stage local state, encode, store and chunk the update, status messages), minus the network. The
loop is `run_simulation`'s, with a clock around each `SiteAgent.poll`: CPU seconds of this thread
(`time.thread_time`; torch runs with one thread, as every site does) and wall seconds. That loop polls every
agent without waiting, thousands of times a round; a poll that received nothing and did no work is counted
apart ("idle"): a deployed agent blocks in its transport instead. The trainer's `train`
and `evaluate` are timed on their own (they hold the local training and the validation pass, and the copies
into and out of torch) and subtracted: what is left is the agent's per-round overhead.

Only rounds 2..R count (round 1 pays one-off costs such as torch's first kernels), and only until the last round
closes (the final evaluation is not a round). `--count-from K` counts rounds K..R instead: a site's steady state,
once its stores have older files to write over (the uplink store keeps three rounds, so from round 4 on every
model-sized file of a site is written over an old one; a new 16 MB file cost up to 30 ms of CPU here).
`--count-from 1` counts the whole run, round 1's one-off costs included (a site's spare files, made there, among
them).
`--baseline-tree DIR` runs the same measurement from another checkout (e.g. `git archive <commit> | tar -x -C DIR`)
in alternating child processes, so both see the same machine load; medians over `--repeats` are printed side by side
with their ratio. `--profile` prints the functions where this tree's agents spend their CPU time (cProfile on the
thread's CPU clock, cumulative, or as AGENT_ROUND_SORT says, e.g. tottime; agent polls only; AGENT_ROUND_CALLERS, a
regular expression, also prints the callers of the functions it matches).

    python bench/agent_round.py --model-mb 16 --sites 2 --rounds 6 --repeats 3 [--baseline-tree /tmp/base]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FEATURES, ROWS, SEED = 64, 400, 0


def model_spec(model_mb: float) -> dict[str, Any]:
    """An MLP 64 -> H -> H -> 1 whose float32 weights take about `model_mb` MB."""
    params = model_mb * 1e6 / 4
    width = int((-(FEATURES + 3) + math.sqrt((FEATURES + 3) ** 2 + 4 * params)) / 2)
    return {"name": "mlp", "args": {"in_features": FEATURES, "hidden": [width, width]}}


def write_sites(folder: Path, n_sites: int) -> dict[str, dict[str, Any]]:
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "features.json"
    spec.write_text(json.dumps({"label": "label", "numeric": [f"f{j:02d}" for j in range(FEATURES)]}))
    truth = np.random.default_rng(SEED).normal(size=FEATURES) / math.sqrt(FEATURES) * 3
    sites = {}
    for i in range(n_sites):
        rng = np.random.default_rng(1000 + i)
        x = rng.normal(size=(ROWS, FEATURES))
        y = (rng.random(ROWS) < 1 / (1 + np.exp(-(x @ truth)))).astype(int)
        path = folder / f"site-{i:02d}.csv"
        header = ",".join([*(f"f{j:02d}" for j in range(FEATURES)), "label"])
        np.savetxt(path, np.column_stack([x, y]), delimiter=",", header=header, comments="",
                   fmt=["%.6f"] * FEATURES + ["%d"])
        sites[f"site-{i:02d}"] = {"format": "table", "path": str(path), "options": {"spec": str(spec)},
                                  "split_seed": i}
    return sites


def measure(work: Path, model_mb: float, n_sites: int, rounds: int, profile: bool,
            breakdown: bool = False, count_from: int = 2) -> dict[str, Any]:
    """One run in this process (the tree on sys.path); per agent-round figures of rounds `count_from`..`rounds`."""
    from fedmqtt.simulation_config import SimulationConfig
    from fedmqtt.transport.heap import tune_heap
    from fedmqtt.transport.memory import MemoryBroker, MemoryTransport
    from fedmqtt.transport.signing import FederationKeys
    from ps_daemon.runner import DaemonRunner
    from site_agent.agent import SiteAgent

    tune_heap()  # as every `fedmqtt` process does
    config = SimulationConfig.model_validate({
        "run_id": "bench", "algorithm": "fedavg", "rounds": rounds, "seed": SEED, "out_dir": str(work / "out"),
        "model": model_spec(model_mb), "sites": write_sites(work / "data", n_sites),
        "train": {"epochs": 1, "batch_size": 64, "lr": 0.001, "optimizer": "adam"}})
    broker = MemoryBroker()

    def factory(**kw: Any) -> MemoryTransport:
        return MemoryTransport(broker, **kw)

    site_cfgs = config.site_configs()
    keys = FederationKeys(config.run_id, ["ps", *(c.site_id for c in site_cfgs)])
    agents = [SiteAgent(c, transport_factory=factory, identity=keys.identity(c.site_id)) for c in site_cfgs]
    runner = DaemonRunner(config.daemon_config(), force=True, transport_factory=factory,
                          identity=keys.identity("ps"))
    inner = {"cpu": 0.0, "wall": 0.0, "calls": 0}
    parts = _time_parts() if breakdown else {}
    for agent in agents:
        agent.start()
        trainer = agent.trainer  # torch loaded before the clock starts
        for name in ("train", "evaluate"):
            setattr(trainer, name, _timed(getattr(trainer, name), inner))
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # CPU time, as the figures above: waits for fsync excluded
    runner.start()
    counted = {"cpu": 0.0, "wall": 0.0}
    idle = {"cpu": 0.0, "wall": 0.0, "polls": 0}  # polls that found nothing to do (the loop spins; see below)
    counting = False
    try:
        while not runner.poll(0):
            closed = len(runner.state.history)
            if closed >= rounds:
                break  # the final evaluation is not a round
            if closed >= count_from - 1 and not counting:  # round count_from - 1 closed: count from the next on
                counting = True
                inner.update(cpu=0.0, wall=0.0, calls=0)
                for part in parts.values():
                    part.update(cpu=0.0, wall=0.0, calls=0)
            for agent in agents:
                seen = (agent.channel.stats.received, agent.channel.fetcher.stats.chunks, inner["calls"])
                c0, w0 = time.thread_time(), time.perf_counter()
                IN_AGENT[0] = counting
                if profiler is not None and counting:
                    profiler.runcall(agent.poll, 0)
                else:
                    agent.poll(0)
                IN_AGENT[0] = False
                if counting:
                    cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
                    if seen == (agent.channel.stats.received, agent.channel.fetcher.stats.chunks, inner["calls"]):
                        idle["cpu"] += cpu
                        idle["wall"] += wall
                        idle["polls"] += 1
                    else:
                        counted["cpu"] += cpu
                        counted["wall"] += wall
    finally:
        for agent in agents:
            agent.close()
        runner.close()
    agent_rounds = n_sites * (rounds - count_from + 1)
    out = {"agent_rounds": agent_rounds, "trainer_calls": inner["calls"],
           "poll_cpu_ms": 1000 * counted["cpu"] / agent_rounds,
           "train_cpu_ms": 1000 * inner["cpu"] / agent_rounds,
           "overhead_cpu_ms": 1000 * (counted["cpu"] - inner["cpu"]) / agent_rounds,
           "overhead_wall_ms": 1000 * (counted["wall"] - inner["wall"]) / agent_rounds,
           "idle_polls": idle["polls"] / agent_rounds, "idle_cpu_ms": 1000 * idle["cpu"] / agent_rounds}
    try:
        from fedmqtt.transport.bulk import REASSEMBLY_MAPS

        out["maps_reused"] = REASSEMBLY_MAPS.reused
    except ImportError:  # an older tree
        pass
    if parts:
        out["parts"] = {name: {"cpu_ms": 1000 * p["cpu"] / agent_rounds, "calls": p["calls"] / agent_rounds}
                        for name, p in parts.items()}
    if profiler is not None:
        import io
        import pstats

        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).sort_stats(os.environ.get("AGENT_ROUND_SORT", "cumulative"))
        stats.print_stats(45)
        if os.environ.get("AGENT_ROUND_CALLERS"):  # a regular expression: who calls the functions it matches
            stats.print_callers(os.environ["AGENT_ROUND_CALLERS"])
        out["profile"] = text.getvalue()
    return out


# Steps of an agent's round, timed where the agent's code looks them up, and only while an agent polls (inclusive
# CPU ms per agent-round; they nest: the upload includes the chunk digests it makes). Names that a tree lacks are
# skipped.
PARTS = {
    "verify a model chunk (SHA-256, store)": ("fedmqtt.transport.bulk", "Fetcher", "on_chunk"),
    "chunk digests (both ways)": ("fedmqtt.transport.bulk", None, "chunk_digest"),
    "reassemble the model (append chunks)": ("fedmqtt.transport.bulk", "_Transfer", "store"),
    "finiteness of tensors (both ways)": ("schemas.tensors", None, "all_finite"),
    "decode + validate a message": ("fedmqtt.transport.channel", None, "decode"),
    "model hash": ("site_agent.agent", None, "tensors_hash"),
    "compose the weights": ("site_agent.agent", "SiteAgent", "_compose"),
    "best slot: keep the evaluated model": ("site_agent.local_state", "BestSlot", "remember"),
    "stage local state": ("site_agent.local_state", "LocalState", "stage"),
    "encode a message": ("site_agent.agent", None, "encode"),
    "store the update (durable)": ("site_agent.store", "UplinkStore", "save"),
    "publish (split, chunks, manifest)": ("fedmqtt.transport.channel", "Channel", "send"),
}


def _time_parts() -> dict[str, dict[str, Any]]:
    import importlib

    parts: dict[str, dict[str, Any]] = {}
    for label, (module_name, class_name, attr) in PARTS.items():
        module = importlib.import_module(module_name)
        owner = getattr(module, class_name) if class_name else module
        if not hasattr(owner, attr):
            continue
        parts[label] = {"cpu": 0.0, "wall": 0.0, "calls": 0}
        setattr(owner, attr, _timed(getattr(owner, attr), parts[label], only_in_agent=True))
    return parts


IN_AGENT = [False]  # set while an agent polls: the PS runs the same functions in this process, uncounted


def _timed(method: Any, into: dict[str, Any], *, only_in_agent: bool = False) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if only_in_agent and not IN_AGENT[0]:
            return method(*args, **kwargs)
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into["cpu"] += time.thread_time() - c0
            into["wall"] += time.perf_counter() - w0
            into["calls"] += 1
    return wrapper


def run_child(tree: Path, args: argparse.Namespace, profile: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fedmqtt-agent-round-") as tmp:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--inner", tmp, "--model-mb", str(args.model_mb),
               "--sites", str(args.sites), "--rounds", str(args.rounds), *(["--profile"] if profile else []),
               *(["--count-from", str(args.count_from)] if args.count_from != 2 else []),
               *(["--breakdown"] if args.breakdown else [])]
        out = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                             text=True)
    if out.returncode != 0:
        raise SystemExit(f"run from {tree} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-mb", type=float, default=16.0)
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--count-from", type=int, default=2,
                        help="first round counted (default 2; 1: the whole run, one-off costs included)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path, default=None, help="also run from this checkout")
    parser.add_argument("--profile", action="store_true", help="print this tree's agent profile (one run)")
    parser.add_argument("--breakdown", action="store_true", help="also time the steps of a round (both trees)")
    parser.add_argument("--inner", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 1 <= args.count_from <= args.rounds:
        parser.error("--count-from must be between 1 and --rounds")
    if args.inner is not None:
        print(json.dumps(measure(args.inner, args.model_mb, args.sites, args.rounds, args.profile,
                                 args.breakdown, args.count_from)))
        return
    here = Path(__file__).resolve().parents[1]
    trees = {"now": here, **({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for name, tree in trees.items():
            runs[name].append(run_child(tree, args, False))
            load.append(os.getloadavg()[0])
    print(f"{args.sites} agents x rounds {args.count_from}-{args.rounds} of a {args.model_mb:g} MB MLP, "
          f"{args.repeats} runs per tree, alternating; load average (1 min) {min(load):.1f}-{max(load):.1f} on "
          f"{os.cpu_count()} CPUs")
    print("per agent-round, medians (ms): poll CPU | train+validate CPU | overhead CPU (runs) | overhead wall | "
          "idle polls: count, CPU")
    base = None
    for name, seen in runs.items():
        med = {k: statistics.median(r[k] for r in seen) for k in seen[0] if k.endswith("_ms")}
        spread = ", ".join(f"{r['overhead_cpu_ms']:.1f}" for r in seen)
        base = base or med
        print(f"{name:>9}: {med['poll_cpu_ms']:7.1f} | {med['train_cpu_ms']:7.1f} | {med['overhead_cpu_ms']:7.1f} "
              f"({spread}) | {med['overhead_wall_ms']:7.1f} | "
              f"{statistics.median(r.get('idle_polls', 0) for r in seen):.0f}, {med.get('idle_cpu_ms', 0):.1f}")
    if "baseline" in runs:
        now = statistics.median(r["overhead_cpu_ms"] for r in runs["now"])
        before = statistics.median(r["overhead_cpu_ms"] for r in runs["baseline"])
        print(f"overhead CPU now / baseline: {now / before:.2f} ({now:.1f} / {before:.1f} ms)")
    if args.breakdown:
        print("steps, CPU ms per agent-round (medians; inclusive, so they nest), " + " | ".join(runs))
        for label in PARTS:
            cells = []
            for seen in runs.values():
                values = [r["parts"][label]["cpu_ms"] for r in seen if label in r.get("parts", {})]
                cells.append(f"{statistics.median(values):6.1f}" if values else "     -")
            print(f"  {label:<40} " + " | ".join(cells))
    if args.profile:
        print(run_child(here, args, True)["profile"])


if __name__ == "__main__":
    main()
