"""Run reports that do not hide failure: task-specific metrics, a constant-predictor baseline for
regression, a report.md for central runs, and readable tables with hundreds of sites."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np

from fedmqtt.data.spec import DataSpec
from fedmqtt.simulation import SimulationConfig, run_simulation
from ps_daemon.report import MAX_SITE_ROWS, final_table, per_site_csv, render_markdown, report_metrics
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


def test_regression_simulation_has_a_constant_baseline_and_central_writes_report_md(tmp_path: Path) -> None:
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
        base = report["baseline"]
        assert 3.0 < base["level"] < 4.5 and base["mean"]["test"]["mae"] > 0
        md = (out / "report.md").read_text()
        assert "auroc" not in md and "baseline mean" in md and "pooled training mean" in md
        assert (out / "per_site.csv").read_text().startswith("site,n_val,n_test")
