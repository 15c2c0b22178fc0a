"""The Central (pooled) baseline writes a report shaped like a federated run's."""

from __future__ import annotations

from pathlib import Path

from fedmqtt.simulation import SimulationConfig, run_simulation
from schemas.messages import ModelSpec, TrainSettings


def test_central_baseline_report_has_the_federated_layout(tmp_path: Path) -> None:
    """Per-round per-site validation metrics and final per-site val/test metrics for every bundled site."""
    # Prepare
    cfg = SimulationConfig(algorithm="central", rounds=2, out_dir=tmp_path,
                           model=ModelSpec(name="mlp", args={"in_features": 15, "hidden": [8]}),
                           train=TrainSettings(epochs=1, batch_size=32, lr=0.01))
    # Execute
    report = run_simulation(cfg, progress=False)
    # Assert
    assert report["algorithm"] == "central" and len(report["rounds"]) == 2
    assert set(report["rounds"][0]["per_site"]) == {"cleveland", "hungary", "switzerland", "va"}
    for entry in report["final"]["per_site"].values():
        assert set(entry["metrics"]) == {"val", "test"} and entry["n_samples"]["test"] > 0
    assert 0.5 < report["final"]["mean"]["test"]["auroc"] <= 1.0
    assert (tmp_path / "report.json").is_file()


def test_saved_models_keep_every_tensor_shape(tmp_path: Path) -> None:
    """final/best model files keep 0-d buffers 0-d; the run manifest lists versions and every model hash."""
    from safetensors.numpy import load_file

    from fedmqtt.training.weights import initial_arrays

    # Prepare
    model = ModelSpec(name="mlp", args={"in_features": 15, "hidden": [8], "norm": "bn"})
    cfg = SimulationConfig(algorithm="fedavg", rounds=2, out_dir=tmp_path, model=model,
                           train=TrainSettings(epochs=1, batch_size=32, lr=0.01))
    # Execute
    report = run_simulation(cfg, progress=False)
    # Assert
    manifest = report["manifest"]
    assert manifest["versions"]["fedmqtt"] and manifest["versions"]["numpy"]
    assert sorted(manifest["model_hashes"]) == ["1", "2", "3"] and len(set(manifest["model_hashes"].values())) == 3
    assert manifest["model_hashes"]["3"] == report["final"]["model_hash"]
    reference = initial_arrays("mlp", dict(model.args), 0)
    for name in ("final_model.safetensors", "best_model.safetensors"):
        saved = load_file(str(tmp_path / name))
        assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in reference.items()}, name


def test_central_final_model_is_scored_on_the_held_out_union(tmp_path: Path) -> None:
    """The pooled run keeps its final weights, so `fedmqtt report --held-out` scores it as the sites did."""
    from fedmqtt.experiments.heldout import held_out_sites, union_table
    from fedmqtt.experiments.runs import load_runs

    # Prepare
    cfg = SimulationConfig(algorithm="central", rounds=2, out_dir=tmp_path / "central",
                           model=ModelSpec(name="mlp", args={"in_features": 15, "hidden": [8]}),
                           train=TrainSettings(epochs=1, batch_size=32, lr=0.01))
    report = run_simulation(cfg, progress=False)
    records = load_runs([cfg.out_dir])
    # Execute
    table = union_table(records, "auroc", held_out_sites(records, dict(cfg.sites)))
    # Assert
    row = next(r for r in table.rows if r.trained_on != "-")
    assert row.pooled is not None and row.per_site is not None
    for site, entry in report["final"]["per_site"].items():
        assert abs(row.per_site[site] - entry["metrics"]["test"]["auroc"]) < 1e-9, site
