"""The papers' own client splits (docs/algorithms.md 16.6): Chen et al.'s AdaFed split (adafed_pairs) and the
natural split of PhysioNet 2012 stays by ICU type (Scheltjens et al.'s natural hospital split, as near as this
data allows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from fedmqtt.data.partition_job import prepare_job
from fedmqtt.data.partitioners import PartitionSpec, adafed_pairs, partition
from fedmqtt.data.spec import DataSpec
from fedmqtt.errors import DataError

# OrganAMNIST's 11 classes in the proportions of the shared .npz (58,830 images, train + val + test).
ORGANA_SHARES = np.array([0.0563, 0.0409, 0.0404, 0.0451, 0.1121, 0.1091, 0.1782, 0.1139, 0.1148, 0.0881, 0.1012])
ORGANA_N = 58_830
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "datasets"


def organa_like_labels(seed: int = 0) -> np.ndarray:
    counts = np.floor(ORGANA_SHARES / ORGANA_SHARES.sum() * ORGANA_N).astype(int)
    counts[-1] += ORGANA_N - counts.sum()
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(11), counts))


def class_statistics(y: np.ndarray, parts: list[np.ndarray]) -> tuple[float, float]:
    """Median over sites of (classes above 5 % of the site, the majority class's share)."""
    shares = [np.bincount(y[p], minlength=11) / len(p) for p in parts]
    return float(np.median([(s > 0.05).sum() for s in shares])), float(np.median([s.max() for s in shares]))


def test_adafed_pairs_gives_equal_sites_with_the_papers_class_mix() -> None:
    """20 sites of n // 20 = 2,941 images each, disjoint; about 6 classes above 5 % and a majority class near
    a quarter (the authors' split on OrganAMNIST: 2,941 per client, 6 classes, 23 %); a plain 20-way label
    skew at the same alpha gives very unequal sites dominated by one or two classes."""
    y = organa_like_labels()
    spec = PartitionSpec(kind="adafed_pairs", n_sites=20, alpha=0.1, seed=0)
    parts = partition(spec, y)
    assert [len(p) for p in parts] == [2941] * 20
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat) == 20 * 2941  # disjoint; the last 10 items belong to no site
    classes, majority = class_statistics(y, parts)
    assert 5 <= classes <= 7 and 0.18 <= majority <= 0.32
    plain = partition(PartitionSpec(kind="label_skew", n_sites=20, alpha=0.1, seed=0), y)
    plain_classes, plain_majority = class_statistics(y, plain)
    assert max(len(p) for p in plain) > 3 * min(len(p) for p in plain)
    assert plain_classes < classes and plain_majority > majority


def test_adafed_pairs_is_deterministic_per_seed() -> None:
    y = organa_like_labels()[:5000]
    a = partition(PartitionSpec(kind="adafed_pairs", n_sites=7, alpha=0.1, seed=3), y)
    b = partition(PartitionSpec(kind="adafed_pairs", n_sites=7, alpha=0.1, seed=3), y)
    c = partition(PartitionSpec(kind="adafed_pairs", n_sites=7, alpha=0.1, seed=4), y)
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c, strict=True))
    assert [len(p) for p in a] == [5000 // 7] * 7  # an odd count: the last block holds one client


def test_adafed_pairs_spec_and_input_checks() -> None:
    with pytest.raises(ValidationError, match="needs alpha"):
        PartitionSpec(kind="adafed_pairs", n_sites=20)
    with pytest.raises(ValidationError, match="n_sites >= 2"):
        PartitionSpec(kind="adafed_pairs", n_sites=1, alpha=0.1)
    with pytest.raises(DataError, match="cannot make 20 sites"):
        adafed_pairs(np.zeros(5, np.int64), 20, 0.1, np.random.default_rng(0))
    with pytest.raises(DataError, match="integer class"):
        partition(PartitionSpec(kind="adafed_pairs", n_sites=2, alpha=0.1), np.linspace(0, 1, 10))


def test_adafed_pairs_on_the_real_organamnist() -> None:
    """The figures the issue quotes from the authors' split, on the shared OrganAMNIST file."""
    path = SHARED / "medmnist" / "organamnist.npz"
    if not path.is_file():
        pytest.skip("needs ../shared/datasets/medmnist/organamnist.npz (not shipped with the repository)")
    with np.load(path) as npz:
        y = np.concatenate([npz[f"{s}_labels"].reshape(-1) for s in ("train", "val", "test")]).astype(np.int64)
    parts = partition(PartitionSpec(kind="adafed_pairs", n_sites=20, alpha=0.1, seed=0), y)
    assert [len(p) for p in parts] == [2941] * 20
    classes, majority = class_statistics(y, parts)
    assert classes == 6 and 0.18 <= majority <= 0.32


def test_natural_split_by_icu_type(tmp_path: Path) -> None:
    """PhysioNet 2012's ICUType is a natural site column: one site per ICU type present."""
    folder = tmp_path / "set-a"
    folder.mkdir()
    types = [1, 2, 3, 4, 2, 3, 3, 4]
    for k, icu in enumerate(types):
        (folder / f"{k:06d}.txt").write_text(f"Time,Parameter,Value\n00:00,RecordID,{1000 + k}\n"
                                             f"00:00,ICUType,{icu}\n01:00,HR,{80 + k}\n")
    (tmp_path / "Outcomes-a.txt").write_text("RecordID,SAPS-I,SOFA,Length_of_stay,Survival,In-hospital_death\n"
                                             + "".join(f"{1000 + k},1,1,{k + 2},-1,0\n" for k in range(8)))
    pooled = DataSpec(format="physionet2012", path=folder, options={"target": "los"})
    job = prepare_job(pooled, PartitionSpec(kind="natural", column="ICUType"))
    done = job.run(tmp_path / "out")
    assert done.names == ["1", "2", "3", "4"]
    assert [p.tolist() for p in done.parts] == [[0], [1, 4], [2, 5, 6], [3, 7]]


def test_a_grid_partition_axis_selects_adafed_pairs(tmp_path: Path) -> None:
    """A grid's `[[partitions]]` entry names the kind like `fedmqtt partition --kind` does; its sites load."""
    from fedmqtt.data.registry import load_site_data
    from fedmqtt.experiments.grid import PartitionAxis, partition_sites

    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 60), ("val", 20), ("test", 40)):
        arrays[f"{split}_images"] = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 4, size=(n, 1)).astype(np.uint8)
    np.savez(tmp_path / "organ.npz", **arrays)
    axis = PartitionAxis.model_validate({
        "name": "adafed", "spec": {"kind": "adafed_pairs", "n_sites": 4, "alpha": 0.1},
        "data": {"format": "medmnist", "path": str(tmp_path / "organ.npz")}})
    sites = partition_sites(axis, 0, tmp_path / "grid")
    assert sorted(sites) == ["site-0", "site-1", "site-2", "site-3"]
    assert [load_site_data(s).n_train + load_site_data(s).n_val + load_site_data(s).n_test
            for s in sites.values()] == [30] * 4
