"""Experiment grids: algorithms x normalisation x seeds x partitions, each point one `run_simulation`."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Collection, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm import tqdm

from fedmqtt.config_io import load_toml, validate_config
from fedmqtt.data.partition_job import MANIFEST_FILE, prepare_job
from fedmqtt.data.partitioners import PartitionSpec, read_partition_manifest
from fedmqtt.data.spec import DataSpec
from fedmqtt.errors import ConfigError, DataError
from fedmqtt.experiments.engines import Engine, SerialEngine
from fedmqtt.experiments.runs import GRID_FILE, POINT_FILE
from fedmqtt.simulation import SimulationConfig
from fedmqtt.strategies.params import HyperValue
from fedmqtt.tracking.spec import TrackSpec

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
log = logging.getLogger(__name__)
MIN_SITE_ITEMS = 3  # a site splits its items into train/val/test (fedmqtt.data.splits)
# Baselines `run_simulation` runs without a federation (fedmqtt.central); they cannot be exported for MQTT.
SIMULATION_ONLY = ("central",)
# SimulationConfig keys the grid sets per point; an algorithm's `config` may set the others.
AXIS_KEYS = frozenset({"algorithm", "seed", "run_id", "out_dir", "model", "train", "hyper", "sites"})
# Norms an algorithm can use; other combinations are skipped, with the reason in grid.json.
NORM_NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "adafed": (("bn",), "its similarity matrix comes from BatchNorm statistics"),
    "f-adafed": (("bn",), "its similarity matrix comes from BatchNorm statistics"),
    "fedfbn": (("bn",), "it freezes BatchNorm layers"),
    "fedbn": (("bn", "ln", "gn"), "without normalisation layers to keep local it is fedavg"),
    "fedpxn": (("bn", "ln", "gn"), "without normalisation layers to keep local it is fedprox"),
}


class AlgorithmSpec(BaseModel):
    """One value of the algorithm axis: a registry name with its own overrides of the base config."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="registry name (see `fedmqtt algorithms`)")
    label: str | None = Field(default=None, pattern=NAME_PATTERN,
                              description="run-name label (default: name), e.g. fedprox-mu0.1")
    hyper: dict[str, HyperValue] = Field(default_factory=dict, description="merged into base.hyper")
    train: dict[str, Any] = Field(default_factory=dict, description="merged into base.train, e.g. SGD")
    config: dict[str, Any] = Field(default_factory=dict,
                                   description="other SimulationConfig keys, e.g. pretrain_fraction")
    norms: tuple[str, ...] | None = Field(default=None, description="only these values of the norm axis")

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _check(self) -> AlgorithmSpec:
        from fedmqtt.strategies import STRATEGIES

        if self.name not in STRATEGIES and self.name not in SIMULATION_ONLY:
            known = ", ".join([*STRATEGIES, *SIMULATION_ONLY])
            raise ValueError(f"unknown algorithm {self.name!r}; available: {known}")
        if bad := sorted(set(self.config) & AXIS_KEYS):
            raise ValueError(f"{self.run_label}: config may not set {bad} (the grid sets them; use hyper/train)")
        return self

    @property
    def run_label(self) -> str:
        return self.label or self.name


class PartitionAxis(BaseModel):
    """A partition: "natural" (base sites as given), or a pooled dataset `data` split by `spec`.

    One manifest per (partition, seed), drawn with PartitionSpec seed `spec.seed + run seed`; each of
    its sites gets `data` plus `partition = <manifest>, site = <id>`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    spec: PartitionSpec | None = None
    data: DataSpec | None = Field(default=None, description="the pooled dataset the spec splits")
    drop_small_sites: bool = Field(default=False, description="leave out sites with too few items to split "
                                   "(extreme skew can leave a site empty) instead of refusing the partition")

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _check(self) -> PartitionAxis:
        if (self.spec is None) != (self.data is None):
            raise ValueError(f"partition {self.name!r}: spec and data go together (omit both for the base sites)")
        if self.data is not None and self.data.partition is not None:
            raise ValueError(f"partition {self.name!r}: data is the pooled dataset, without partition/site")
        return self


class GridSpec(BaseModel):
    """A grid TOML: `[base]` (SimulationConfig keys) and the axes algorithms, norms, seeds, partitions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base: SimulationConfig = Field(default_factory=SimulationConfig)
    algorithms: tuple[AlgorithmSpec, ...] = Field(min_length=1)
    norms: tuple[str, ...] | None = Field(default=None, min_length=1,
                                          description="values of base.model.args.norm (default: as in base)")
    seeds: tuple[int, ...] = Field(default=(0,), min_length=1)
    partitions: tuple[PartitionAxis, ...] = Field(default=(PartitionAxis(name="natural"),), min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> GridSpec:
        for what, values in (("algorithm label", [a.run_label for a in self.algorithms]),
                             ("norm", list(self.norms or ())), ("seed", list(self.seeds)),
                             ("partition name", [p.name for p in self.partitions])):
            if len(set(values)) != len(values):
                raise ValueError(f"duplicate {what} in {values} (give algorithms distinct `label`s)")
        return self


class GridPoint(BaseModel):
    """One run of the grid; `name` is its folder under the grid's out_dir."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    algorithm: AlgorithmSpec
    norm: str
    set_norm: bool = Field(description="whether to write norm into model.args (False: base left as is)")
    seed: int
    partition: PartitionAxis
    base: SimulationConfig

    @property
    def name(self) -> str:
        return f"{self.algorithm.run_label}-{self.norm}-s{self.seed}-{self.partition.name}"

    def labels(self) -> dict[str, Any]:
        """What `fedmqtt report` groups by (written beside the run as grid_point.json)."""
        return {"run": self.name, "algorithm": self.algorithm.run_label, "strategy": self.algorithm.name,
                "norm": self.norm, "seed": self.seed, "partition": self.partition.name}


def load_grid(path: Path) -> GridSpec:
    """A grid TOML; relative paths (base sites, pooled data, pretrained, init_model) resolve against its folder."""
    grid = load_toml(path, GridSpec)
    root = Path(path).resolve().parent
    base = grid.base
    updates: dict[str, Any] = {"sites": {s: d.resolved(root) for s, d in base.sites.items()}}
    if base.pretrained is not None and not base.pretrained.is_absolute():
        updates["pretrained"] = root / base.pretrained
    if base.init_model is not None:
        updates["init_model"] = base.init_model.resolved(root)
    parts = tuple(p if p.data is None else p.model_copy(update={"data": p.data.resolved(root)})
                  for p in grid.partitions)
    return grid.model_copy(update={"base": base.model_copy(update=updates), "partitions": parts})


def _norm_axis(grid: GridSpec) -> tuple[list[str], bool]:
    if grid.norms is not None:
        return list(grid.norms), True
    return [str(grid.base.model.args.get("norm", "none"))], False


def _norm_problem(alg: AlgorithmSpec, norm: str) -> str | None:
    if alg.norms is not None and norm not in alg.norms:
        return f"{alg.run_label} runs only with norms {list(alg.norms)}"
    needs, why = NORM_NEEDS.get(alg.name, ((), ""))
    if needs and norm not in needs:
        return f"{alg.name} needs norm in {list(needs)}: {why}"
    return None


def expand(grid: GridSpec) -> list[GridPoint]:
    """Every runnable point, partitions outermost, then algorithms, norms and seeds (the grid's order)."""
    norms, set_norm = _norm_axis(grid)
    return [GridPoint(algorithm=alg, norm=norm, set_norm=set_norm, seed=seed, partition=part, base=grid.base)
            for part in grid.partitions for alg in grid.algorithms for norm in norms
            if _norm_problem(alg, norm) is None for seed in grid.seeds]


def skipped_combinations(grid: GridSpec) -> list[dict[str, str]]:
    """The (algorithm, norm) pairs `expand` leaves out, with the reason."""
    norms, _ = _norm_axis(grid)
    return [{"algorithm": alg.run_label, "norm": norm, "reason": why} for alg in grid.algorithms
            for norm in norms if (why := _norm_problem(alg, norm)) is not None]


def point_to_simulation_config(point: GridPoint, out_dir: Path) -> SimulationConfig:
    """The point's SimulationConfig, writing into `out_dir/<point.name>`.

    For a partitioned point the manifest `out_dir/partitions/<partition>-s<seed>/partition.json` is
    written first when missing (deterministic: the same spec and seed give the same file).

    To run one point over MQTT: `fedmqtt grid GRID.toml --out DIR --only RUN --export` writes
    `DIR/configs/RUN/simulation.toml` (the same run via `fedmqtt simulate`), `ps.toml` and
    `sites/<id>.toml` (made from this config by `daemon_config()` and `site_configs()`). Then
    `fedmqtt broker init --dir fed --run-id <run_id of ps.toml> --site <id> ...` (the ids of `sites/`),
    `fedmqtt broker start --dir fed`, `fedmqtt ps start --config ps.toml` and, at each site,
    `fedmqtt site start --config sites/<id>.toml`. Same config and seed: bit-identical final weights
    to the simulated point on CPU (docs/design-notes.md, "One code path: simulation = deployment").
    A point that pretrains in simulation
    (`pretrain_fraction`) is simulated once first, so that its `pretrained.safetensors` exists.
    """
    alg, base = point.algorithm, point.base
    args = {**base.model.args, **({"norm": point.norm} if point.set_norm else {})}
    sites = base.sites if point.partition.spec is None else partition_sites(point.partition, point.seed, out_dir)
    data = {**base.model_dump(), **alg.config, "algorithm": alg.name, "seed": point.seed,
            "run_id": run_id_of(point.name), "out_dir": Path(out_dir) / point.name,
            "model": {"name": base.model.name, "args": args}, "hyper": {**base.hyper, **alg.hyper},
            "train": {**base.train.model_dump(), **alg.train}, "sites": sites}
    return validate_config(data, SimulationConfig, source=f"grid point {point.name}")


def run_id_of(name: str) -> str:
    """A run name as a valid run id ([a-z0-9-], at most 63 characters)."""
    return (re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-") or "run")[:63].rstrip("-")


def partition_sites(axis: PartitionAxis, seed: int, out_dir: Path) -> dict[str, DataSpec]:
    """The site DataSpecs of `axis` for run seed `seed` (its manifest written when missing)."""
    assert axis.spec is not None and axis.data is not None  # natural axes never get here
    folder = (Path(out_dir) / "partitions" / f"{axis.name}-s{seed}").resolve()
    path = folder / MANIFEST_FILE
    if not path.is_file():  # what `fedmqtt partition` writes, with the point's seed added to the spec's
        spec = axis.spec.model_copy(update={"seed": axis.spec.seed + seed})
        job = prepare_job(axis.data, spec, dataset=str(axis.data.path))
        job.run(folder, title=f"{spec.kind} (seed {spec.seed})")
    manifest = read_partition_manifest(path)
    # Caught before the grid starts, rather than by every run of this partition failing.
    small = [f"{p.site} ({p.n})" for p in manifest.sites if p.n < MIN_SITE_ITEMS]
    if small and axis.drop_small_sites:
        log.warning("partition %s, seed %d: leaving out %s (too few items)", axis.name, seed, ", ".join(small))
    elif small:
        raise DataError(f"partition {axis.name!r}, seed {seed}: sites with fewer than {MIN_SITE_ITEMS} items "
                        f"(too few to split train/val/test): {', '.join(small)}; raise alpha or lower n_sites "
                        f"({path})")
    pooled = axis.data.model_dump()
    return {part.site: DataSpec.model_validate({**pooled, "partition": path, "site": part.site})
            for part in manifest.sites if part.n >= MIN_SITE_ITEMS}


def run_grid(grid: GridSpec, out_dir: Path, *, resume: bool = True, progress: bool = True,
             only: Collection[str] | None = None, engine: Engine | None = None,
             track: Sequence[TrackSpec] = (), experiment: str = "grid") -> list[dict[str, Any]]:
    """Run every point (or those named in `only`) with `run_simulation` into `out_dir/<run name>/`.

    Every config is built and validated before the first run, so a bad key stops the grid at once.
    With `resume`, a point whose report.json exists and whose stored config is unchanged is skipped
    ("cached"). A failing point is recorded ("failed", with the error) and the grid goes on.
    `out_dir/grid.json` (points, status, wall time, skipped combinations) is rewritten after each point.

    `engine` runs the points (default: `SerialEngine`, one after another in this process); each point
    is `run_point` on plain data, so a `DaskEngine` runs the same code on its workers and the results
    are the same bits. A remote engine gets `out_dir` as an absolute path, which every worker must see.
    With `progress=False` nothing draws a bar: not the grid, not a run.

    `track` (fedmqtt.tracking): each point that runs is one tracked run named by the point, in the MLflow
    experiment `experiment`, and in its own folder of `out_dir/tensorboard` (or of the spec's DIR). Cached
    points are not logged again.

    Returns:
        The grid.json entries of the points run (all, or those in `only`; grid.json lists every point).
    """
    engine = engine or SerialEngine()
    out_dir = Path(out_dir).resolve() if engine.remote else Path(out_dir)
    every = expand(grid)
    points = [p for p in every if only is None or p.name in only]
    if only is not None and (unknown := set(only) - {p.name for p in points}):
        raise ConfigError(f"no grid point named {', '.join(sorted(unknown))}; see `fedmqtt grid --list`")
    tracking = {"track": [str(t) for t in track], "track_root": str(out_dir), "experiment": experiment}
    jobs = [(p.name, {"labels": p.labels(), "config": _validated(p, out_dir).model_dump(mode="json"),
                      "resume": resume, **tracking}) for p in points]
    on_disk = {p.name: "cached" if (out_dir / p.name / "report.json").is_file() else "pending" for p in every}
    entries = {p.name: {**p.labels(), "status": on_disk[p.name], "wall_s": None} for p in every}
    bar = tqdm(total=len(points), desc=f"grid ({engine.name})", unit="run", disable=not progress)
    try:
        with closing(engine.run(run_point, jobs)) as outcomes:
            for name, outcome in outcomes:
                entries[name].update(outcome if isinstance(outcome, dict) else _engine_failure(outcome))
                _write_grid_json(out_dir, grid, list(entries.values()))
                bar.set_postfix_str(name)
                bar.update(1)
    finally:
        bar.close()
    _write_grid_json(out_dir, grid, list(entries.values()))
    return [entries[p.name] for p in points]


def _validated(point: GridPoint, out_dir: Path) -> SimulationConfig:
    """The point's config, checked as the PS would check it (algorithm, hyper-parameters, SGD-only...)."""
    cfg = point_to_simulation_config(point, out_dir)
    try:
        cfg.daemon_config()
    except ConfigError as exc:
        raise ConfigError(f"grid point {point.name}: {exc}") from None
    return cfg


def run_point(labels: dict[str, Any], config: dict[str, Any], *, resume: bool, track: Sequence[str] = (),
              track_root: str = ".", experiment: str = "grid") -> dict[str, Any]:
    """One grid point, from plain data only (its labels and its SimulationConfig as JSON), so that an
    engine can ship it to another process or machine; returns its grid.json status and wall time.
    `track`: `--track` values, the point tracked as a run named by it under `track_root` (run_grid).

    Torch threads need no setting here: every simulated site pins them (SiteConfig.threads = 1), as
    do the pooled baseline and pretraining, so a worker computes the same bits as this process.
    """
    from fedmqtt.simulation import run_simulation
    from fedmqtt.tracking import parse_track, tracked_run

    cfg = SimulationConfig.model_validate(config)
    run_dir = cfg.out_dir
    meta = {**labels, "config": config}
    report, meta_path = run_dir / "report.json", run_dir / POINT_FILE
    if resume and report.is_file() and meta_path.is_file() and json.loads(meta_path.read_text()) == meta:
        total = json.loads(report.read_text()).get("timings", {}).get("total_s")
        return {"status": "cached", "wall_s": total}
    report.unlink(missing_ok=True)  # a stale report must not pass for this config's
    run_dir.mkdir(parents=True, exist_ok=True)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    start = time.perf_counter()
    specs = [parse_track(t) for t in track]
    tags = {f"grid.{k}": str(v) for k, v in labels.items()}
    try:
        # A tracker that cannot open (its package missing on this worker) fails the point before it trains.
        with tracked_run(specs, root=Path(track_root), run_name=labels["run"], experiment=experiment,
                         config={"grid": labels, **config}, tags=tags) as tracker:
            run_simulation(cfg, progress=False, tracker=tracker)
    except Exception as exc:  # noqa: BLE001 - one diverged or misconfigured point must not stop a sweep
        return {"status": "failed", "wall_s": time.perf_counter() - start, "error": f"{type(exc).__name__}: {exc}"}
    return {"status": "done", "wall_s": time.perf_counter() - start}


def _engine_failure(exc: BaseException) -> dict[str, Any]:
    """A point the engine could not run (its worker died, the worker lacks a package...): failed, as a
    point whose own run raised."""
    return {"status": "failed", "wall_s": None, "error": f"{type(exc).__name__}: {exc}"}


def _write_grid_json(out_dir: Path, grid: GridSpec, entries: list[dict[str, Any]]) -> None:
    doc = {"version": "fedmqtt.grid/1", "spec": grid.model_dump(mode="json"),
           "skipped": skipped_combinations(grid), "points": entries}
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (GRID_FILE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out_dir / GRID_FILE)
