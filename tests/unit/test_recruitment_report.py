"""`fedmqtt report` on a recruited run and an all-sites run: both final models scored on the same held-out
union (every site's test split), pooled per patient and per-site mean side by side (issue 13, item 6)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest
from typer.testing import CliRunner

from fedmqtt.cli import app
from fedmqtt.experiments.heldout import held_out_sites, union_table
from fedmqtt.experiments.runs import RunRecord, load_runs
from fedmqtt.simulation import SimulationConfig, run_simulation
from fedmqtt.training.holdout import load_test_splits

NOT_RECRUITED = "switzerland"  # at gamma_th 0.5 the bundled heart sites recruit cleveland, hungary and va


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recruit")
    out = {}
    for name, selection in (("all", "all"), ("recruited", "recruited")):
        cfg = SimulationConfig(run_id=name, rounds=1, out_dir=root / name, selection=selection,
                               recruitment={"gamma_th": 0.5} if selection == "recruited" else {})
        run_simulation(cfg, progress=False)
        out[name] = cfg.out_dir
    (root / "sites.toml").write_text('run_id = "heart"\n')  # the default sites: the bundled hospitals
    out["sites"] = root / "sites.toml"
    return out


def own_test(run: Path, metric: str) -> dict[str, float | None]:
    per_site = json.loads((run / "report.json").read_text())["final"]["per_site"]
    return {s: e["metrics"]["test"].get(metric) if "metrics" in e else None for s, e in per_site.items()}


def test_union_scores_every_site_as_the_sites_do(runs: dict[str, Path]) -> None:
    records = load_runs([runs["all"], runs["recruited"]])
    sites = SimulationConfig().sites
    table = union_table(records, "auroc", dict(sites))
    all_row, rec_row, constant = table.rows
    assert constant.label == "constant for log-loss and accuracy" and constant.pooled == 0.5
    assert "any constant scores 0.5" in constant.note
    assert all_row.per_site == pytest.approx(own_test(runs["all"], "auroc"), abs=1e-9)
    own = own_test(runs["recruited"], "auroc")
    assert own[NOT_RECRUITED] is None  # its own report: not recruited, no metrics
    assert rec_row.per_site is not None and rec_row.per_site[NOT_RECRUITED] is not None
    assert {s: v for s, v in rec_row.per_site.items() if s != NOT_RECRUITED} == pytest.approx(
        {s: v for s, v in own.items() if s != NOT_RECRUITED}, abs=1e-9)
    assert rec_row.trained_on == "3 of 4 (recruited)" and all_row.trained_on == "4 of 4"
    assert table.patients == sum(len(s.y) for s in load_test_splits(dict(sites)).values())


def test_pooled_accuracy_weighs_sites_by_test_size(runs: dict[str, Path]) -> None:
    sites = dict(SimulationConfig().sites)
    sizes = {s: len(t.y) for s, t in load_test_splits(sites).items()}
    for row in union_table(load_runs([runs["all"], runs["recruited"]]), "accuracy", sites).rows:
        assert row.per_site is not None
        weighted = sum(sizes[s] * row.per_site[s] for s in sizes) / sum(sizes.values())
        assert row.pooled == pytest.approx(weighted, abs=1e-12)
        assert row.site_mean.mean == pytest.approx(np.mean(list(row.per_site.values())), abs=1e-12)


def test_cli_needs_the_sites_data_then_prints_both_side_by_side(runs: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    cli = CliRunner()
    # A run whose report does not record its sites' data (e.g. a deployment's PS): --test-sites names them.
    bare = []
    for name in ("all", "recruited"):
        (tmp_path / name).mkdir()
        report = json.loads((runs[name] / "report.json").read_text())
        (tmp_path / name / "report.json").write_text(json.dumps({k: v for k, v in report.items() if k != "site_data"}))
        bare.append(str(tmp_path / name))
    missing = cli.invoke(app, ["report", *bare, "--metric", "auroc", "--held-out"])
    assert missing.exit_code == 2, missing.output
    assert "--test-sites" in missing.output
    # Simulations record their sites' data: no --test-sites needed, and naming them agrees.
    args = ["report", str(runs["all"]), str(runs["recruited"]), "--metric", "auroc"]
    recorded = cli.invoke(app, args)
    assert recorded.exit_code == 0, recorded.output
    done = cli.invoke(app, [*args, "--test-sites", str(runs["sites"]), "--out", str(tmp_path)])
    assert done.exit_code == 0, done.output
    assert recorded.output.split("held-out union")[1] == done.output.split("held-out union")[1].split("report:")[0]
    assert "fedavg [all]" in done.output and "fedavg [recruited]" in done.output  # not two seeds of one row
    assert "held-out union" in done.output and "3 of 4 (recruited)" in done.output
    assert "held-out union" in (tmp_path / "report.md").read_text()
    plain = cli.invoke(app, [*args, "--no-held-out"])
    assert plain.exit_code == 0 and "held-out union" not in plain.output


def test_conflicting_site_data_is_refused(runs: dict[str, Path]) -> None:
    from fedmqtt.errors import ConfigError

    records = load_runs([runs["all"]])
    sites = dict(SimulationConfig().sites)
    assert held_out_sites(records, sites) == dict(sorted(sites.items()))
    other = {**sites, "va": sites["hungary"]}
    (runs["all"] / "grid_point.json").write_text(json.dumps({"config": {"sites": {
        k: v.model_dump(mode="json") for k, v in sites.items()}}}))
    try:
        with pytest.raises(ConfigError, match="site va"):
            held_out_sites(load_runs([runs["all"]]), other)
    finally:
        (runs["all"] / "grid_point.json").unlink()


def test_regression_union_has_a_row_per_metric_optimal_constant(tmp_path: Path) -> None:
    """A regression run's held-out table ends with every metric-optimal constant of the simulation's report on
    the same patients: per site as the report's own scores, pooled over every test patient. (Until issue
    "results are claims" it had one row, the pooled training mean, whatever the metric.)"""
    from fedmqtt.data.spec import DataSpec
    from schemas.messages import ModelSpec, TrainSettings

    rng = np.random.default_rng(2)
    sites = {}
    for k, scale in enumerate((1.0, 2.0, 4.0)):
        a, b = rng.normal(size=60), rng.normal(size=60)
        days = np.maximum(0.1, scale * (3 + a + 0.5 * b + 0.3 * rng.normal(size=60)))
        path = tmp_path / f"site{k}.csv"
        path.write_text("a,b,los\n" + "".join(f"{x},{y},{z}\n" for x, y, z in zip(a, b, days, strict=True)))
        sites[f"site-{k}"] = DataSpec(format="table", path=path, options={"spec": {
            "label": "los", "task": "regression", "numeric": ["a", "b"]}})
    cfg = SimulationConfig(run_id="los", rounds=1, out_dir=tmp_path / "run", sites=sites,
                           selection_metric="mae",
                           model=ModelSpec(name="mlp", args={"in_features": 2, "hidden": [8]}),
                           train=TrainSettings(epochs=1, batch_size=16, lr=0.01, optimizer="adam",
                                               loss="msle"))
    report = run_simulation(cfg, progress=False)
    table = union_table(load_runs([cfg.out_dir]), "mae", dict(sites))
    model_row, *constants = table.rows
    assert [c.label for c in constants] == ["constant for MSE", "constant for MAE", "constant for MSLE",
                                            "constant for MAPE"]
    median = next(c for c in report["baselines"]["constants"] if c["name"] == "MAE")
    own = {s: e["metrics"]["test"]["mae"] for s, e in median["per_site"].items()}
    assert constants[1].per_site == pytest.approx(own, abs=1e-9)
    splits = load_test_splits(dict(sites))
    y = np.concatenate([splits[s].y for s in sorted(splits)]).astype(np.float64)
    assert constants[1].pooled == pytest.approx(float(np.mean(np.abs(y - median["value"]))), rel=1e-9)
    assert constants[0].note.startswith(f"best constant for MSE: mean y = {report['baseline']['level']:.4g}")
    assert model_row.pooled is not None


def test_union_reads_the_single_baseline_of_an_older_report(tmp_path: Path) -> None:
    """A report written before `baselines` existed still gets its constant row (the pooled training mean)."""
    from fedmqtt.data.base import TaskInfo
    from fedmqtt.experiments.heldout import report_constants

    (old,) = report_constants({"baseline": {"level": 2.5}}, TaskInfo("regression"))
    assert old.label == "constant (pooled training mean)" and old.constant.predict(3).tolist() == [2.5] * 3
    assert report_constants({}, TaskInfo("regression")) == []


def test_seeds_of_one_natural_split_share_their_sites(tmp_path: Path) -> None:
    """A grid writes each seed its own manifest: identical items for a site are the same site, other items not."""
    from fedmqtt.data.partitioners import PartitionSpec, write_partition_manifest
    from fedmqtt.data.spec import DataSpec
    from fedmqtt.errors import ConfigError
    from fedmqtt.experiments.heldout import same_site_data

    source = {"format": "heart_disease", "path": "pooled.csv", "n_items": 6}
    spec = PartitionSpec(kind="natural", column="source")

    def manifest(name: str, parts: list[list[int]]) -> DataSpec:
        path = tmp_path / name / "partition.json"
        path.parent.mkdir()
        write_partition_manifest(path, spec, [np.asarray(p) for p in parts], [{}, {}], source, site_names=["a", "b"])
        return DataSpec(format="heart_disease", path=tmp_path / "pooled.csv", partition=path, site="a")

    seed0, seed1 = manifest("s0", [[0, 1, 2], [3, 4, 5]]), manifest("s1", [[0, 1, 2], [3, 4, 5]])
    moved = manifest("s2", [[0, 1, 3], [2, 4, 5]])
    assert same_site_data("a", seed0, seed1) and not same_site_data("a", seed0, moved)
    assert not same_site_data("a", seed0, seed1.model_copy(update={"split_seed": 1}))
    runs = []
    for k, site_spec in enumerate((seed0, seed1, moved)):
        run = tmp_path / f"run{k}"
        run.mkdir()
        point = {"config": {"sites": {"a": site_spec.model_dump(mode="json")}}}
        (run / "grid_point.json").write_text(json.dumps(point))
        runs.append(run)

    def records(*folders: Path) -> list[RunRecord]:  # held_out_sites reads only each record's folder
        return cast(list[RunRecord], [SimpleNamespace(path=f) for f in folders])

    assert held_out_sites(records(runs[0], runs[1]))["a"] == seed0
    with pytest.raises(ConfigError, match="site a"):
        held_out_sites(records(runs[0], runs[2]))
