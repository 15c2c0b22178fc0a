"""Experiment grids: TOML, expansion and skips, partition manifests per seed, exports, a tiny real grid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib
from typer.testing import CliRunner

from fedmqtt.cli import app
from fedmqtt.data.partitioners import read_partition_manifest
from fedmqtt.errors import ConfigError, DataError
from fedmqtt.experiments.export import export_point, to_toml
from fedmqtt.experiments.grid import (
    expand,
    load_grid,
    point_to_simulation_config,
    run_grid,
    skipped_combinations,
)
from fedmqtt.simulation import load_simulation_config
from ps_daemon.config import load_daemon_config
from site_agent.config import load_site_config

MODEL = '[base.model]\nname = "mlp"\nargs = { in_features = 15, hidden = [8], norm = "none" }\n'
HEADER = ("id,gender,age,hypertension,heart_disease,ever_married,work_type,Residence_type,avg_glucose_level,"
          "bmi,smoking_status,stroke")


def grid_file(tmp_path: Path, axes: str, base: str = "[base]\nrounds = 1\n" + MODEL) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(axes + "\n" + base)
    return path


def stroke_csv(tmp_path: Path, n: int = 80) -> Path:
    rows = [f"{k},{'Male' if k % 2 else 'Female'},{20 + k},0,0,Yes,Private,{'Urban' if k % 3 else 'Rural'},"
            f"{100 + (k * 7) % 50},{20 + k % 11},never smoked,{int(k % 4 == 0)}" for k in range(n)]
    path = tmp_path / "stroke.csv"
    path.write_text(HEADER + "\n" + "\n".join(rows) + "\n")
    return path


def test_expand_names_points_and_skips_norms_an_algorithm_cannot_use(tmp_path: Path) -> None:
    """Names read algorithm-norm-sSEED-partition; adafed/fedbn without a norm layer are skipped."""
    # Prepare
    path = grid_file(tmp_path, 'algorithms = ["fedavg", { name = "scaffold", train = { optimizer = "sgd" } },'
                               ' "fedbn", { name = "adafed", config = { pretrain_fraction = 0.2 } }]\n'
                               'norms = ["none", "bn"]\nseeds = [0, 1]\n')
    # Execute
    grid = load_grid(path)
    names = [p.name for p in expand(grid)]
    # Assert
    assert names[:4] == ["fedavg-none-s0-natural", "fedavg-none-s1-natural", "fedavg-bn-s0-natural",
                         "fedavg-bn-s1-natural"]
    assert len(names) == 2 * 2 * 2 + 2 + 2 and "adafed-none-s0-natural" not in names
    assert [(s["algorithm"], s["norm"]) for s in skipped_combinations(grid)] == [("fedbn", "none"),
                                                                                 ("adafed", "none")]
    cfg = point_to_simulation_config(expand(grid)[6], tmp_path / "out")  # scaffold-bn-s0
    assert (cfg.algorithm, cfg.seed, cfg.train.optimizer, cfg.model.args["norm"]) == ("scaffold", 0, "sgd", "bn")
    assert cfg.out_dir == tmp_path / "out" / "scaffold-bn-s0-natural" and cfg.run_id == "scaffold-bn-s0-natural"
    assert sorted(cfg.sites) == ["cleveland", "hungary", "switzerland", "va"]


@pytest.mark.parametrize(("axes", "message"), [
    ('algorithms = ["fedavgg"]', "unknown algorithm 'fedavgg'"),
    ('algorithms = [{ name = "fedavg", config = { seed = 3 } }]', "config may not set ['seed']"),
    ('algorithms = ["fedprox", "fedprox"]', "duplicate algorithm label"),
    ('algorithms = ["fedavg"]\npartitions = [{ name = "x", spec = { kind = "iid", n_sites = 2 } }]',
     "spec and data go together"),
])
def test_bad_grid_is_a_config_error_naming_the_problem(tmp_path: Path, axes: str, message: str) -> None:
    """Mistakes in the axes fail when the file is read."""
    # Prepare
    path = grid_file(tmp_path, axes)
    # Execute / Assert
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_grid(path)


def partitioned_grid(tmp_path: Path, spec: str) -> Path:
    csv = stroke_csv(tmp_path)
    base = '[base]\nrounds = 1\n[base.model]\nname = "mlp"\nargs = { in_features = 18, hidden = [8] }\n'
    return grid_file(tmp_path, f'algorithms = ["fedavg"]\nseeds = [0, 1]\n[[partitions]]\nname = "skew"\n'
                               f'spec = {spec}\ndata = {{ format = "table", path = "{csv.name}", '
                               'options = { spec = "stroke" } }\n', base)


def test_partition_axis_writes_a_manifest_per_seed(tmp_path: Path) -> None:
    """Each (partition, seed) gets its manifest (spec seed + run seed) and sites that read their part."""
    # Prepare
    grid = load_grid(partitioned_grid(tmp_path, '{ kind = "label_skew", n_sites = 3, alpha = 5.0, seed = 10 }'))
    # Execute
    configs = [point_to_simulation_config(p, tmp_path / "out") for p in expand(grid)]
    # Assert
    manifests = [tmp_path / "out" / "partitions" / f"skew-s{s}" / "partition.json" for s in (0, 1)]
    assert [read_partition_manifest(m).spec.seed for m in manifests] == [10, 11]
    assert (manifests[0].parent / "partition.png").is_file()
    for cfg, manifest in zip(configs, manifests, strict=True):
        assert sorted(cfg.sites) == ["site-0", "site-1", "site-2"]
        spec = cfg.sites["site-1"]
        assert (spec.partition, spec.site, spec.path) == (manifest.resolve(), "site-1", tmp_path / "stroke.csv")


def test_partition_leaving_a_site_too_small_is_refused_before_running(tmp_path: Path) -> None:
    """A site with fewer than 3 items could not split train/val/test: a DataError names it at once."""
    # Prepare
    grid = load_grid(partitioned_grid(tmp_path, '{ kind = "quantity_skew", n_sites = 6, alpha = 0.05 }'))
    # Execute / Assert
    with pytest.raises(DataError, match="partition 'skew', seed 0: sites with fewer than 3 items"):
        run_grid(grid, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "grid.json").exists()


def test_to_toml_round_trips_nested_tables() -> None:
    """Nested tables, inline tables in lists, quoted keys and None left out."""
    # Prepare
    data = {"a": 1, "b": None, "t": {"x": [1, 2], "sub": {"s.k": "v\"q", "f": 0.5}, "empty": {}},
            "l": [{"k": True}], "only": {"inner": {"z": 1}}}
    # Execute
    back = tomllib.loads(to_toml(data))
    # Assert
    assert back == {"a": 1, "t": {"x": [1, 2], "sub": {"s.k": "v\"q", "f": 0.5}, "empty": {}},
                    "l": [{"k": True}], "only": {"inner": {"z": 1}}}


def test_export_writes_simulation_ps_and_site_configs_that_load(tmp_path: Path) -> None:
    """A point exported for MQTT: simulation.toml, ps.toml and sites/<id>.toml all validate."""
    # Prepare
    grid = load_grid(grid_file(tmp_path, 'algorithms = [{ name = "fedprox", hyper = { mu = 0.1 } }]'))
    (point,) = expand(grid)
    # Execute
    folder = export_point(point, tmp_path / "out", fed_dir=tmp_path / "fed")
    # Assert
    sim = load_simulation_config(folder / "simulation.toml")
    ps = load_daemon_config(folder / "ps.toml")
    site = load_site_config(folder / "sites" / "va.toml")
    assert sim.hyper == ps.hyper == {"mu": 0.1} and ps.run_id == site.run_id == sim.run_id
    assert ps.credentials == (tmp_path / "fed" / "credentials" / "ps.toml").resolve()
    assert site.data.path == sim.sites["va"].path and sorted(ps.sites) == sorted(sim.sites)


def test_simulation_only_baseline_is_simulated_but_not_exported_for_mqtt(tmp_path: Path) -> None:
    """"central" (pooled) is a valid grid algorithm; its export has simulation.toml and a note, no ps.toml."""
    # Prepare
    grid = load_grid(grid_file(tmp_path, 'algorithms = ["central"]'))
    (point,) = expand(grid)
    # Execute
    folder = export_point(point, tmp_path / "out", fed_dir=tmp_path / "fed")
    # Assert
    assert load_simulation_config(folder / "simulation.toml").algorithm == "central"
    assert not (folder / "ps.toml").exists()
    assert "simulation-only baseline" in (folder / "NOT-EXPORTED.txt").read_text()


def test_tiny_grid_runs_resumes_and_reports(tmp_path: Path) -> None:
    """2 algorithms x 1 norm x 2 seeds on the bundled sites: run, resume (cached), then `fedmqtt report`."""
    # Prepare
    grid = load_grid(grid_file(tmp_path, 'algorithms = ["fedavg", "fedprox"]\nnorms = ["none"]\nseeds = [0, 1]'))
    out = tmp_path / "out"
    # Execute
    first = run_grid(grid, out, progress=False)
    again = run_grid(grid, out, progress=False)
    result = CliRunner().invoke(app, ["report", str(out), "--metric", "auroc", "--out", str(out / "report")])
    # Assert
    assert [e["status"] for e in first] == ["done"] * 4 and [e["status"] for e in again] == ["cached"] * 4
    doc = json.loads((out / "grid.json").read_text())
    assert [p["run"] for p in doc["points"]] == ["fedavg-none-s0-natural", "fedavg-none-s1-natural",
                                                 "fedprox-none-s0-natural", "fedprox-none-s1-natural"]
    assert all(p["wall_s"] > 0 for p in doc["points"])
    assert result.exit_code == 0, result.output
    assert "fedavg" in result.output and "fedprox" in result.output and "cleveland" in result.output
    assert (out / "report" / "report.md").is_file()
    assert (out / "report" / "sites_auroc_natural.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("flag", "bars"), [("--progress", {"grid (serial)"}), ("--no-progress", set())])
def test_no_progress_silences_every_bar_of_the_grid(tmp_path: Path, capfd: pytest.CaptureFixture[str], flag: str,
                                                    bars: set[str]) -> None:
    """Run alone, "central" and a federation each draw a per-round bar; in a grid only the grid's own bar may
    show, and with --no-progress nothing draws one (not the grid, not a run)."""
    # Prepare
    path = grid_file(tmp_path, 'algorithms = ["central", "fedavg"]\nnorms = ["none"]')
    # Execute
    result = CliRunner().invoke(app, ["grid", str(path), "--out", str(tmp_path / "out"), "--engine", "serial", flag])
    written = result.stderr + result.stdout + capfd.readouterr().err
    # Assert
    assert result.exit_code == 0, result.output
    assert {m.strip() for m in re.findall(r"([\w() -]+):\s+\d+%\|", written)} == bars, written


@pytest.mark.parametrize(("cpus", "points", "workers", "expected"), [
    (2, 6, None, ("dask", 2)),  # both cores by default
    (16, 6, None, ("dask", 2)),  # two, not one per CPU: each run holds a whole federation in memory
    (16, 6, 4, ("dask", 4)),
    (2, 1, None, ("serial", None)),  # one run gains nothing from a cluster
    (1, 6, None, ("serial", None)),
    (2, 6, 1, ("serial", None)),
])
def test_auto_engine_uses_both_cores_where_it_can(monkeypatch: pytest.MonkeyPatch, cpus: int, points: int,
                                                  workers: int | None, expected: tuple[str, int | None]) -> None:
    from fedmqtt.experiments import engines

    monkeypatch.setattr(engines.os, "cpu_count", lambda: cpus)
    engine = engines.make_engine("auto", workers=workers, points=points)
    assert (engine.name, getattr(engine, "workers", None)) == expected


def test_auto_engine_runs_serially_without_dask(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedmqtt.errors import ConfigError
    from fedmqtt.experiments import engines

    def missing() -> None:
        raise ConfigError("no dask")

    monkeypatch.setattr(engines, "_import_distributed", missing)
    assert engines.make_engine("auto", points=4).name == "serial"
    with pytest.raises(ConfigError, match="--workers go with --engine dask"):
        engines.make_engine("serial", workers=2)
