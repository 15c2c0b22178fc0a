"""Run reports that do not hide failure: task-specific metrics, metric-optimal constants and a pooled
reference model, a report.md for central runs, and readable tables with hundreds of sites."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np

from fedmqtt.data.spec import DataSpec
from fedmqtt.simulation import SimulationConfig, run_simulation
from ps_daemon.report import MAX_SITE_ROWS, final_table, per_site_csv, render_markdown, report_metrics, summary_table
from schemas.messages import ModelSpec, TrainSettings


def _report(n_sites: int, kind: str = "binary") -> dict[str, Any]:
    names = ("auroc", "accuracy") if kind == "binary" else ("mae", "mse", "msle")
    per_site = {}
    for k in range(n_sites):
        metrics = {split: {m: 0.5 + k / (2 * n_sites) for m in names} for split in ("val", "test")}
        per_site[f"h{k:03d}"] = {"metrics": metrics, "n_samples": {"val": 10, "test": 10}, "undefined": {}}
    per_site["h999"] = {"missing": "no final report (site offline or past the deadline)"}
    mean = {split: dict.fromkeys(names, 0.75) for split in ("val", "test")}
    rounds = [{"round": 1, "sites": list(per_site), "mean": dict.fromkeys(names, 0.7), "train_loss": 0.3}]
    return {"run_id": "r", "algorithm": "fedavg", "final": {"per_site": per_site, "mean": mean},
            "rounds": rounds, "timings": {"total_s": 1.0}, "traffic": {"bytes_sent": 1, "bytes_received": 2}}


def test_regression_report_shows_regression_metrics_only() -> None:
    report = _report(3, kind="regression")
    assert report_metrics(report) == ("mae", "mse", "msle")
    md = render_markdown(report)
    assert "auroc" not in md and "accuracy" not in md and "test mae" in md and "val msle" in md
    assert final_table(_report(3))[0] == ["site", "n_test", "test auroc", "test accuracy", "note"]  # as before


def test_two_hundred_sites_summary_in_markdown_full_table_in_csv() -> None:
    report = _report(200)
    md = render_markdown(report)
    assert "h150" not in md and "per_site.csv" in md and len(md.splitlines()) < 40
    assert "| auroc | 200 of 201 |" in md  # defined at 200 sites, one site missing
    rows = list(csv.reader(io.StringIO(per_site_csv(report))))
    assert len(rows) == 202 and rows[0][:3] == ["site", "n_val", "n_test"]
    assert rows[-1][0] == "h999" and rows[-1][-1].startswith("no final report")
    assert float(rows[1 + 150][rows[0].index("test auroc")]) == 0.5 + 150 / 400
    assert len(render_markdown(_report(MAX_SITE_ROWS - 1)).splitlines()) > MAX_SITE_ROWS  # few: every site


def _regression_site(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(30, 2))
    y = 3.0 + x[:, 0].clip(min=0) + 0.1 * rng.random(30)
    path.write_text("a,b,los\n" + "".join(f"{a:.6f},{b:.6f},{t:.6f}\n" for (a, b), t in zip(x, y, strict=True)))
    return path


def test_regression_simulation_has_metric_optimal_constants_and_central_writes_report_md(tmp_path: Path) -> None:
    spec = {"label": "los", "task": "regression", "numeric": ["a", "b"]}
    sites = {s: DataSpec(format="table", path=_regression_site(tmp_path / f"{s}.csv", k), options={"spec": spec})
             for k, s in enumerate(("h1", "h2"))}
    model = ModelSpec(name="mlp", args={"in_features": 2, "hidden": [8], "norm": "none"})
    train = TrainSettings(epochs=1, batch_size=8, lr=0.01, optimizer="adam", loss="msle")
    for algorithm in ("fedavg", "central"):
        out = tmp_path / algorithm
        cfg = SimulationConfig(algorithm=algorithm, rounds=2, sites=sites, model=model, train=train,
                               selection_metric="mae", out_dir=out)
        report = run_simulation(cfg, progress=False)
        base = report["baseline"]  # the single entry older readers know: the pooled training mean
        assert 3.0 < base["level"] < 4.5 and base["mean"]["test"]["mae"] > 0
        constants = {c["name"]: c for c in report["baselines"]["constants"]}
        assert set(constants) == {"MSE", "MAE", "MSLE", "MAPE"} and constants["MSE"]["value"] == base["level"]
        assert report["baselines"]["pooled_reference"]["fitted"]
        md = (out / "report.md").read_text()
        # Until issue "results are claims" the table had one "baseline mean" row, the training mean, optimal
        # for MSE only; now a row per metric-optimal constant, the pooled reference and the site alone.
        assert "auroc" not in md and "| constant for MSLE |" in md and "expm1(mean log1p y)" in md
        assert "| pooled reference |" in md and "| site alone |" in md
        assert (out / "per_site.csv").read_text().startswith("site,n_val,n_test")


def test_many_sites_summary_shows_each_metrics_own_constant_and_the_warnings() -> None:
    """With many sites the summary gives, per metric, the constant optimal for that metric (not one
    constant for all), the pooled reference and the site alone; warnings follow the table."""
    report = _report(40, kind="regression")

    def entry(value: float) -> dict[str, Any]:
        return {"mean": {"test": {"mae": value, "mse": value + 1, "msle": value + 2}}}
    report["baselines"] = {
        "fitted_on": "the pooled training rows of 40 sites (400 rows)",
        "constants": [{"metrics": ["mse"], "name": "MSE", "what": "mean", **entry(10.0)},
                      {"metrics": ["mae"], "name": "MAE", "what": "median", **entry(20.0)},
                      {"metrics": ["msle"], "name": "MSLE", "what": "log mean", **entry(30.0)}],
        "pooled_reference": {"fitted": False, "why": "inputs are images or signals"},
        "site_alone": {"what": "own constant", **entry(0.5)},
        "warnings": ["the site alone predicts the target better than the federated model (...): the partition "
                     "leaks the label"]}
    rows = summary_table(report)
    assert rows[0][-3:] == ["best constant", "pooled reference", "site alone"]
    by_metric = {r[0]: r[-3:] for r in rows[1:]}
    assert by_metric == {"mae": ["20.000", "n/a", "0.500"], "mse": ["11.000", "n/a", "1.500"],
                         "msle": ["32.000", "n/a", "2.500"]}
    md = render_markdown(report)
    assert "No pooled reference model: inputs are images or signals." in md
    assert "**Warning:** the site alone predicts the target better" in md
