"""A simulation's `feature_statistics`: every site, the pooled reference and the held-out scoring standardise with
the federation's statistics, combined from the sites' summaries as the PS would combine them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedmqtt.data.feature_stats import standardise_with
from fedmqtt.data.feature_wire import read_statistics
from fedmqtt.data.registry import _site_items, _split, load_dataset, load_site_data, site_train_summary
from fedmqtt.federation_stats import STATISTICS_FILE, with_federation_statistics
from fedmqtt.simulation import SimulationConfig, run_simulation
from schemas.messages import ModelSpec, TrainSettings

MLP = ModelSpec(name="mlp", args={"in_features": 15, "hidden": [8]})


def test_every_site_standardises_with_the_federation_statistics(tmp_path: Path) -> None:
    cfg = with_federation_statistics(SimulationConfig(out_dir=tmp_path, feature_statistics="federated"))
    path = tmp_path / STATISTICS_FILE
    assert all(spec.statistics == path.resolve() for spec in cfg.sites.values())
    data = {site: load_site_data(spec) for site, spec in cfg.sites.items()}
    stats = read_statistics(path, next(iter(data.values())).feature_names)
    for site, spec in cfg.sites.items():
        items, _, _ = _site_items(spec, load_dataset(spec))
        train, _, test, _ = _split(spec, items)
        np.testing.assert_array_equal(data[site].x_test, standardise_with(items.x[test], stats))
        assert any("federation's statistics" in note for note in data[site].notes)
    pooled = np.concatenate([d.x_train for d in data.values()])
    moving = pooled.std(axis=0) > 0
    # every site standardised alike: the pooled training rows are centred and scaled, not each site's own
    assert np.abs(pooled.mean(axis=0)).max() < 0.05
    np.testing.assert_allclose(pooled.std(axis=0)[moving], 1.0, atol=0.05)
    per_site_means = np.array([d.x_train.mean(axis=0) for d in data.values()])
    assert np.abs(per_site_means).max() > 0.3  # the sites differ, and now it shows


def test_auto_uses_the_federation_for_small_sites_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = with_federation_statistics(SimulationConfig(out_dir=tmp_path / "a", feature_statistics="auto"))
    assert all(spec.statistics is not None for spec in small.sites.values())  # 74-182 training rows each
    monkeypatch.setattr("fedmqtt.federation_stats.SMALL_SITE_ROWS", 50)
    large = SimulationConfig(out_dir=tmp_path / "b", feature_statistics="auto")
    assert with_federation_statistics(large) == large
    local = SimulationConfig(out_dir=tmp_path / "c")
    assert local.feature_statistics == "site" and with_federation_statistics(local) == local


def test_images_have_no_column_statistics(tmp_path: Path) -> None:
    from fedmqtt.data.base import TaskInfo
    from fedmqtt.data.registry import Dataset
    from fedmqtt.data.spec import DataSpec
    from fedmqtt.errors import DataError

    images = Dataset(x=np.zeros((20, 1, 2, 2), dtype=np.float32), y=np.arange(20) % 2,
                     task=TaskInfo("multiclass", 2, ("0", "1")), feature_names=("channel_0",), layout="image")
    with pytest.raises(DataError, match="tables and ICU stays, not image"):
        site_train_summary(DataSpec(format="medmnist", path=tmp_path / "x.npz"), dataset=images)


def test_a_site_summary_carries_only_sums(tmp_path: Path) -> None:
    """What leaves a site: counts, sums, sums of squares and bin counts, none of them a single patient's value
    (a column seen fewer than MIN_VALUES times is withheld)."""
    spec = SimulationConfig().sites["switzerland"]
    item = site_train_summary(spec)
    assert item.summary.histogram.shape == (15, 512) and item.n_train == 73
    assert (item.summary.count == 0).sum() >= 1  # columns never (or under MIN_VALUES times) seen there
    assert ((item.summary.count == 0) | (item.summary.count >= 5)).all()


def test_simulation_and_central_use_the_same_statistics(tmp_path: Path) -> None:
    train = TrainSettings(epochs=1, batch_size=32, lr=0.01)
    fed = run_simulation(SimulationConfig(rounds=1, out_dir=tmp_path / "fed", model=MLP, train=train,
                                          feature_statistics="federated"), progress=False)
    central = run_simulation(SimulationConfig(algorithm="central", rounds=1, out_dir=tmp_path / "central",
                                              model=MLP, train=train, feature_statistics="federated"),
                             progress=False)
    a = (tmp_path / "fed" / STATISTICS_FILE).read_bytes()
    b = (tmp_path / "central" / STATISTICS_FILE).read_bytes()
    assert json.loads(a)["mean"] == json.loads(b)["mean"] and json.loads(a)["std"] == json.loads(b)["std"]
    for report, run in ((fed, "fed"), (central, "central")):
        sites = report["site_data"]
        assert all(Path(s["statistics"]) == (tmp_path / run / STATISTICS_FILE).resolve() for s in sites.values())
    # the held-out scoring reads each run's test splits as its sites did
    from fedmqtt.experiments.heldout import run_test_splits
    from fedmqtt.training.holdout import load_test_splits

    own = SimulationConfig().sites
    local = load_test_splits(own)
    cache: dict = {}
    read = run_test_splits(tmp_path / "fed", own, local, cache)
    assert run_test_splits(tmp_path / "central", own, local, cache) is read  # one federation, one copy
    for site, spec in own.items():
        fed_spec = spec.model_copy(update={"statistics": (tmp_path / "fed" / STATISTICS_FILE).resolve()})
        np.testing.assert_array_equal(read[site].x, load_site_data(fed_spec).x_test)
        assert not np.array_equal(read[site].x, local[site].x)
    assert run_test_splits(tmp_path, own, local, cache) is local  # no statistics file: the sites' own


def test_the_run_statistics_are_those_of_the_pooled_training_rows(tmp_path: Path) -> None:
    """What the simulation writes equals the rule applied to every site's training rows pooled (the sums add
    exactly; no bundled site has a column seen in 1-4 rows, which it would withhold)."""
    from fedmqtt.data.feature_stats import derive, summarise

    cfg = with_federation_statistics(SimulationConfig(out_dir=tmp_path, feature_statistics="federated"))
    rows, grid = [], None
    for spec in SimulationConfig().sites.values():
        items, _, _ = _site_items(spec, load_dataset(spec))
        train, _, _, _ = _split(spec, items)
        rows.append(items.x[train])
        grid = site_train_summary(spec).grid
    assert grid is not None
    want = derive(summarise(np.concatenate(rows), grid), grid)
    names = load_dataset(next(iter(cfg.sites.values()))).feature_names
    got = read_statistics(tmp_path / STATISTICS_FILE, names)
    for field in ("low", "high", "fill", "mean", "std"):
        np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=1e-12)
