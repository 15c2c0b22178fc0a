"""A simulated FedAvg round against the same work in a bare torch loop (issue 30, goal 1).

Setting (Chen et al.'s on OrganAMNIST, docs/results/organamnist): 20 clients by Dirichlet label skew alpha 0.1,
each splitting its images 45/10/45 train/val/test, LeNet-5 with BatchNorm, SGD lr 0.01, batch 32, one local
epoch. The simulated side is `fedmqtt.simulation.run_simulation` (PS runner, 20 site agents, in-memory broker,
codec, signatures, strategies); the bare side is what a researcher would write by hand: the zoo's LeNet-5,
the same clients' images as tensors, per client a copy of the global weights, a validation pass (accuracy)
and one shuffled epoch of SGD, then the weighted average of the clients' state dicts; after the last round
the final model's accuracy on every client's validation and test split and the best round's model (by
validation accuracy) on every test split, as the simulation's sites score them (the simulation's metrics are
a full suite, the bare loop's accuracy only).

Both sides run in this process with one torch thread (as every simulated site does), interleaved A,B,A,B over
`--repeats`, so load hits both alike. A side's round time is the wall time between the closes of rounds
2..R (round 1 pays one-off costs; the simulation's start and its final evaluation and baselines are not
rounds), and "whole run / R" is everything a run takes (the simulation's start, data, final evaluation,
baselines and report; the bare loop's data and rounds) divided by its rounds, against the bare loop without
and with its final evaluation. Each is printed as wall time and as this process's CPU time (steadier than
wall time on a shared machine), per repeat and as medians, with the ratios, the load average, the CPU seconds
a round the simulation spent in its PS, and each side's phases: start (the simulation's data, sites and PS;
the bare loop's data), round 1, rounds 2..R, final evaluation, report (the simulation's baselines and files).

    python bench/sim_vs_bare.py --rounds 4 --repeats 3 [--data ../shared/datasets/medmnist/organamnist.npz]
    python bench/sim_vs_bare.py --profile sim|bare   # rounds 2..R of one run of one side under cProfile
    python bench/sim_vs_bare.py --profile sim --whole  # the whole run (start to report) under cProfile
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "medmnist" / "organamnist.npz"
N_SITES, ALPHA, LR, BATCH = 20, 0.1, 0.01, 32


def _eval_rows() -> int:
    """Rows per forward pass when a site scores a split on the CPU: the bare loop uses the same (this script
    also runs against trees from before the constant, which scored 1024 rows at a time)."""
    from fedmqtt.training import evaluate

    return int(getattr(evaluate, "CPU_BATCH_ROWS", 1024))


EVAL_ROWS = _eval_rows()


def simulation_config(data: Path, out: Path, rounds: int, seed: int = 0) -> Any:
    """The simulated run's config: the grid's partition of `data` (written under `out`), FedAvg, LeNet-5 BN."""
    from fedmqtt.data.partitioners import PartitionSpec
    from fedmqtt.data.spec import DataSpec
    from fedmqtt.experiments.grid import PartitionAxis, partition_sites
    from fedmqtt.simulation import SimulationConfig

    axis = PartitionAxis(name="label_skew", spec=PartitionSpec(kind="label_skew", n_sites=N_SITES, alpha=ALPHA),
                         data=DataSpec(format="medmnist", path=data, fractions=(0.45, 0.1, 0.45)),
                         drop_small_sites=True)
    sites = partition_sites(axis, seed, out)
    return SimulationConfig.model_validate({
        "algorithm": "fedavg", "rounds": rounds, "seed": seed, "selection_metric": "accuracy",
        "out_dir": out / "sim", "sites": sites,
        "model": {"name": "lenet5", "args": {"n_classes": 11, "in_channels": 1, "norm": "bn"}},
        "train": {"epochs": 1, "batch_size": BATCH, "lr": LR, "optimizer": "sgd"}})


def run_sim(config: Any, profiler: Any = None) -> Timing:
    """One simulated run: the wall and CPU seconds of each of its rounds 2..R (`profiler` runs during those),
    and of the whole `run_simulation` call (start, data, every round, final evaluation, baselines, report)."""
    import fedmqtt.simulation as simulation
    from fedmqtt.simulation import run_simulation
    from fedmqtt.tracking import RunTracker
    from ps_daemon.runner import DaemonRunner

    closes: list[tuple[float, float]] = []
    marks: dict[str, tuple[float, float]] = {}
    ps_cpu = [0.0]
    poll, start_ps, close_ps = DaemonRunner.poll, DaemonRunner.start, DaemonRunner.close
    finish = simulation.finish_report

    def timed_poll(runner: DaemonRunner, timeout_s: float) -> bool:
        started = time.process_time()
        try:
            return poll(runner, timeout_s)
        finally:
            if 1 <= len(closes) < config.rounds:  # between the closes of round 1 and round R
                ps_cpu[0] += time.process_time() - started

    class Clock(RunTracker):
        def round_closed(self, metrics: Any) -> None:
            closes.append((time.perf_counter(), time.process_time()))
            if profiler is not None:
                (profiler.enable if metrics.round == 1 else profiler.disable if metrics.round == config.rounds
                 else _nothing)()

    def marked(name: str, call: Any, *, after: bool = False) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not after:
                marks[name] = _now()
            try:
                return call(*args, **kwargs)
            finally:
                if after:
                    marks[name] = _now()
        return wrapper

    tracker = Clock([])
    start = _now()
    # The bench's own clocks on the class and module, put back below: the PS's poll, the end of the start
    # (the agents are built and started before the PS), the end of the final evaluation (the loop ends, the PS
    # closes) and the report (baselines, files) after it.
    patches = [(DaemonRunner, "poll", timed_poll), (DaemonRunner, "start", marked("started", start_ps)),
               (DaemonRunner, "close", marked("evaluated", close_ps, after=True)),
               (simulation, "finish_report", marked("reported", finish, after=True))]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        run_simulation(config, progress=False, tracker=tracker)
    finally:
        for (owner, name, _), value in zip(patches, (poll, start_ps, close_ps, finish), strict=True):
            setattr(owner, name, value)
    tracker.close()
    end = _now()
    phases = _phases(start, [marks["started"], closes[0], closes[-1], marks["evaluated"], end])
    return Timing(_rounds(closes), _since(start), ps_cpu[0] / max(1, config.rounds - 1), phases)


class Client(NamedTuple):
    x: Any  # training images, float32 tensor
    y: Any  # training labels, int64 tensor
    x_val: Any
    y_val: Any
    x_test: Any
    y_test: Any
    n: int  # training rows


def load_clients(config: Any) -> list[Client]:
    """Every client's training, validation and test split as tensors, as the sites load them (the pooled file
    read once, as a hand-written loop would)."""
    import torch

    from fedmqtt.data.registry import load_dataset
    from site_agent.data import load_site_data

    specs = [spec for _site, spec in sorted(config.sites.items())]
    pooled = load_dataset(specs[0].model_copy(update={"partition": None, "site": None}))
    out = []
    for spec in specs:
        d = load_site_data(spec, dataset=pooled)
        out.append(Client(*(torch.as_tensor(a, dtype=torch.float32 if i % 2 == 0 else torch.int64)
                            for i, a in enumerate((d.x_train, d.y_train, d.x_val, d.y_val, d.x_test, d.y_test))),
                          len(d.y_train)))
    return out


def run_bare(config: Any, profiler: Any = None) -> Timing:
    """The same work by hand: rounds 2..R as `run_sim`; the whole run (the clients' data loaded, every round)
    and, timed apart, the final evaluation a researcher needs from it (`_bare_final_evaluation`)."""
    start = _now()
    clients = load_clients(config)
    loaded = _now()
    closes, final, best = _bare_rounds(clients, config.rounds, seed=config.seed, profiler=profiler)
    whole = _since(start)
    _bare_final_evaluation(clients, final, best)
    end = _now()
    return Timing(_rounds(closes), whole, phases=_phases(start, [loaded, closes[0], closes[-1], end]),
                  evaluated=_since(start))


def _bare_final_evaluation(clients: list[Client], final: dict[str, Any], best: dict[str, Any]) -> None:
    """What the simulation's sites do once the last round has closed, by hand: the final model's accuracy on
    every client's validation and test split, and the best round's model (by validation accuracy, already known
    from its round) on every test split."""
    from fedmqtt.training.zoo import LeNet5

    model = LeNet5(n_classes=11, in_channels=1, norm="bn")
    for state, splits in ((final, ("val", "test")), (best, ("test",))):
        model.load_state_dict(state)
        for c in clients:
            for split in splits:
                x, y = (c.x_val, c.y_val) if split == "val" else (c.x_test, c.y_test)
                _accuracy(model, x, y)


def _accuracy(model: Any, x: Any, y: Any) -> float:
    """Softmax in float64 over eval-mode batches of EVAL_ROWS (as the sites score a split), then accuracy."""
    import torch

    model.eval()
    with torch.inference_mode():
        probs = torch.cat([torch.softmax(model(x[s:s + EVAL_ROWS]).double(), dim=1)
                           for s in range(0, x.shape[0], EVAL_ROWS)])
    return float((probs.argmax(dim=1) == y).double().mean()) if len(y) else 0.0


def _bare_rounds(clients: list[Client], rounds: int, *, seed: int,
                 profiler: Any) -> tuple[list[tuple[float, float]], dict[str, Any], dict[str, Any]]:
    import torch
    from torch.nn import functional as F

    from fedmqtt.training.zoo import LeNet5

    torch.manual_seed(seed)
    model = LeNet5(n_classes=11, in_channels=1, norm="bn")
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    best: tuple[float, dict[str, Any]] = (-1.0, global_state)
    closes = []
    for round_no in range(rounds):
        states, sizes, val_accuracy = [], [], 0.0
        for i, c in enumerate(clients):
            x, y, n = c.x, c.y, c.n
            model.load_state_dict(global_state)
            val_accuracy += _accuracy(model, c.x_val, c.y_val) * len(c.y_val)
            model.train()
            params = list(model.parameters())
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1000 * round_no + i))
            for start in range(0, n, BATCH):
                idx = order[start:start + BATCH]
                if len(idx) == 1:
                    continue
                for p in params:
                    p.grad = None
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                with torch.no_grad():  # plain SGD, torch.optim's arithmetic without its class's per-step cost
                    for p in params:
                        p.add_(p.grad, alpha=-LR)
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            sizes.append(n)
        if val_accuracy > best[0]:  # the model every client validated this round, by weighted accuracy
            best = (val_accuracy, global_state)
        total = float(sum(sizes))
        global_state = {k: (sum(s[k].double() * (w / total) for s, w in zip(states, sizes, strict=True))
                            .to(v.dtype)) for k, v in states[0].items()}
        closes.append((time.perf_counter(), time.process_time()))
        if profiler is not None:
            (profiler.enable if round_no == 0 else profiler.disable if round_no == rounds - 1 else _nothing)()
    return closes, global_state, best[1]


def _nothing() -> None:
    pass


class Timing(NamedTuple):
    rounds: list[tuple[float, float]]  # (wall, CPU) seconds of rounds 2..R
    whole: tuple[float, float]  # (wall, CPU) seconds of the whole run (the bare loop's without its final evaluation)
    ps_cpu: float = 0.0  # CPU seconds a round (2..R) spent in the PS runner's poll (the simulation is one thread)
    phases: tuple[tuple[float, float], ...] = ()  # (wall, CPU) of each of PHASES ("report": the simulation's only)
    evaluated: tuple[float, float] | None = None  # the bare loop's whole run with its final evaluation


PHASES = ("start", "round 1", "rounds 2..R", "final evaluation", "report")


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    return time.perf_counter() - start[0], time.process_time() - start[1]


def _phases(start: tuple[float, float], marks: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """(wall, CPU) between consecutive marks, the first from `start`."""
    edges = [start, *marks]
    return tuple((b[0] - a[0], b[1] - a[1]) for a, b in zip(edges, edges[1:], strict=False))


def _rounds(closes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(wall, CPU) seconds between consecutive round closes."""
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(closes, closes[1:], strict=False)]


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="organamnist.npz")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run (rounds 2..R are timed)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved")
    parser.add_argument("--profile", choices=("sim", "bare"), help="one run of one side under cProfile")
    parser.add_argument("--whole", action="store_true",
                        help="with --profile: profile the whole run (start to report), not rounds 2..R")
    args = parser.parse_args()
    if not args.data.is_file():
        sys.exit(f"no {args.data}: see ../shared/datasets/medmnist/PROVENANCE.md")
    import torch

    torch.set_num_threads(1)  # as every simulated site runs (SiteConfig.threads = 1)
    with tempfile.TemporaryDirectory(prefix="sim-vs-bare-") as tmp:
        config = simulation_config(args.data.resolve(), Path(tmp), args.rounds)
        clients = load_clients(config)
        print(f"{len(clients)} clients, {sum(c.n for c in clients)} training images, "
              f"{sum(c.x_val.shape[0] for c in clients)} validation and {sum(c.x_test.shape[0] for c in clients)} "
              f"test images; {args.rounds} rounds, 2..{args.rounds} timed as rounds; splits scored {EVAL_ROWS} rows "
              f"at a time; torch {torch.__version__}, 1 thread; load {load()}", flush=True)
        del clients
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile(time.process_time)  # CPU seconds: steadier than wall time under load
            if args.whole:
                profiler.enable()
            timing = run_sim(config, None if args.whole else profiler) if args.profile == "sim" else run_bare(
                config, None if args.whole else profiler)
            profiler.disable()
            for name, (wall, cpu) in zip(PHASES, timing.phases, strict=False):
                print(f"  {name:17s} {wall:7.3f} s (CPU {cpu:7.3f})")
            print(f"{args.profile}: {_median(timing.rounds, 0):.3f} s/round")
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(50)
            return
        rows: list[dict[str, float]] = []
        for repeat in range(args.repeats):
            sim, bare = run_sim(config), run_bare(config)  # A, B, A, B...
            row = {"sim": _median(sim.rounds, 0), "bare": _median(bare.rounds, 0),
                   "sim_cpu": _median(sim.rounds, 1), "bare_cpu": _median(bare.rounds, 1),
                   "sim_whole": sim.whole[0] / args.rounds, "bare_whole": bare.whole[0] / args.rounds,
                   "sim_whole_cpu": sim.whole[1] / args.rounds, "bare_whole_cpu": bare.whole[1] / args.rounds,
                   "bare_eval": bare.evaluated[0] / args.rounds, "bare_eval_cpu": bare.evaluated[1] / args.rounds,
                   "ps_cpu": sim.ps_cpu}
            for side, timing in (("sim", sim), ("bare", bare)):
                for name, (wall, cpu) in zip(PHASES, timing.phases, strict=False):
                    row[f"{side} {name}"], row[f"{side} {name} cpu"] = wall, cpu
            rows.append(row)
            print(f"repeat {repeat + 1}: {_line(row)}; load {load()}", flush=True)
            print(_phase_lines(row), flush=True)
        median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        if args.repeats > 1:
            print(f"median of {args.repeats}: {_line(median)}; load {load()}")
            print(_phase_lines(median))


def _line(r: dict[str, float]) -> str:
    return (f"round (2..R) simulation {r['sim']:.3f} s, bare {r['bare']:.3f} s, ratio {r['sim'] / r['bare']:.3f} "
            f"(CPU {r['sim_cpu']:.3f} / {r['bare_cpu']:.3f} = {r['sim_cpu'] / r['bare_cpu']:.3f}); "
            f"whole run / R: simulation {r['sim_whole']:.3f} s, bare {r['bare_whole']:.3f} s, "
            f"ratio {r['sim_whole'] / r['bare_whole']:.3f} (CPU {r['sim_whole_cpu']:.3f} / {r['bare_whole_cpu']:.3f} = "
            f"{r['sim_whole_cpu'] / r['bare_whole_cpu']:.3f}); whole run / R against a bare loop that also scores "
            f"its final and best-round models: bare {r['bare_eval']:.3f} s, "
            f"ratio {r['sim_whole'] / r['bare_eval']:.3f} "
            f"(CPU {r['bare_eval_cpu']:.3f}, ratio {r['sim_whole_cpu'] / r['bare_eval_cpu']:.3f}); "
            f"PS CPU {r['ps_cpu']:.3f} s/round")


def _phase_lines(r: dict[str, float]) -> str:
    """Each phase's wall and CPU seconds on both sides (whole phases: "rounds 2..R" is R - 1 rounds)."""
    lines = []
    for name in PHASES:
        sides = [f"{side} {r[f'{side} {name}']:7.3f} s (CPU {r[f'{side} {name} cpu']:7.3f})"
                 for side in ("sim", "bare") if f"{side} {name}" in r]
        lines.append(f"  {name:17s} " + ", ".join(sides))
    return "\n".join(lines)


def _median(pairs: list[tuple[float, float]], which: int) -> float:
    return statistics.median(p[which] for p in pairs)

if __name__ == "__main__":
    main()
