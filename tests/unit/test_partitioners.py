"""Heterogeneity partitioners (docs/algorithms.md 16): the cut rule, each DECISION and worked example, I/O."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedmqtt.data.base import TaskInfo
from fedmqtt.data.partitioners import (
    PartitionSpec,
    cut_sizes,
    feature_intervals,
    feature_samples,
    heterogeneity_level,
    label_histograms,
    partition,
    pick_feature,
    read_partition_manifest,
    site_name,
    site_names_for,
    split_by_class,
    write_partition_manifest,
)  # fmt: skip
from fedmqtt.errors import DataError

AGES = np.array([18, 25, 33, 47, 52, 61, 70, 85], dtype=float)


def labels(n: int = 2000, classes: int = 4, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, size=n)


def as_sets(parts: list[np.ndarray], values: np.ndarray) -> list[list[float]]:
    return [sorted(values[p].tolist()) for p in parts]


# --- the cut rule (16, common rules) --------------------------------------------------------------------


def test_cut_rule_unstratified_example() -> None:
    """16.1: 10 items with p = (0.55, 0.3, 0.15) split 5/3/2 (Milasheuski et al.'s plain floor gives 5/3/1)."""
    assert cut_sizes(10, (0.55, 0.3, 0.15)).tolist() == [5, 3, 2]


def test_cut_rule_epsilon_guards_float_sums() -> None:
    """0.7 + 0.1 = 0.7999999999999999; the 1e-9 guard still cuts 10 items at 8 (7/1/2, not 7/0/3)."""
    assert (0.7 + 0.1) * 10 < 8
    assert cut_sizes(10, (0.7, 0.1, 0.2)).tolist() == [7, 1, 2]


@pytest.mark.parametrize("n", [0, 1, 7, 100, 1001])
def test_cut_rule_assigns_every_item(n: int) -> None:
    """Every item is assigned, whatever the proportions."""
    p = np.random.default_rng(n).dirichlet(np.ones(5))
    sizes = cut_sizes(n, p)
    assert sizes.sum() == n and (sizes >= 0).all()


# --- quantity skew (16.1) --------------------------------------------------------------------------------


def test_quantity_skew_stratified_example() -> None:
    """16.1 DECISION example: 12 of class 0, 8 of class 1, p = (0.5, 0.3, 0.2): 6/3/3 + 4/2/2 = 10/5/5."""
    y = np.array([0] * 12 + [1] * 8)
    p = np.array([0.5, 0.3, 0.2])
    parts = split_by_class(y, [p, p], np.random.default_rng(0))
    assert [len(part) for part in parts] == [10, 5, 5]
    assert [np.bincount(y[part], minlength=2).tolist() for part in parts] == [[6, 4], [3, 2], [3, 2]]


def test_quantity_skew_sizes_and_label_proportions() -> None:
    """Sizes differ from floor(p_i |D|) by at most the class count; label shares match up to rounding."""
    y = labels(3000, classes=5)
    spec = PartitionSpec(kind="quantity_skew", n_sites=6, alpha=0.5, seed=11)
    parts = partition(spec, y)
    p = np.random.default_rng(11).dirichlet(np.full(6, 0.5))  # the partitioner's first draw
    sizes = np.array([len(part) for part in parts])
    assert np.abs(sizes - np.floor(p * len(y))).max() <= 5
    class_sizes = np.bincount(y)
    for k, part in enumerate(parts):
        assert np.all(np.abs(np.bincount(y[part], minlength=5) - p[k] * class_sizes) < 1 + 1e-9)


def test_quantity_skew_without_labels_is_unstratified() -> None:
    """Without class labels (regression, multilabel) quantity skew cuts one shuffled list."""
    parts = partition(PartitionSpec(kind="quantity_skew", n_sites=3, alpha=1.0, seed=2), None, n_items=10)
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))


# --- label skew (16.2) -----------------------------------------------------------------------------------


def test_label_skew_example() -> None:
    """16.2 example: q0 = (0.75, 0.25), q1 = (0.1, 0.9) on 10 + 10 samples: clients get 7 + 1 and 3 + 9."""
    y = np.array([0] * 10 + [1] * 10)
    parts = split_by_class(y, [np.array([0.75, 0.25]), np.array([0.1, 0.9])], np.random.default_rng(0))
    assert [np.bincount(y[part], minlength=2).tolist() for part in parts] == [[7, 1], [3, 9]]


def test_label_skew_large_alpha_is_near_iid() -> None:
    """alpha = 1e4 (homogeneous): every site's class shares are within 0.03 of the pooled shares."""
    y = labels(20000, classes=4)
    parts = partition(PartitionSpec(kind="label_skew", n_sites=5, alpha=1e4, seed=3), y)
    pooled = np.bincount(y) / len(y)
    for part in parts:
        assert np.abs(np.bincount(y[part], minlength=4) / len(part) - pooled).max() < 0.03


def test_label_skew_small_alpha_is_skewed() -> None:
    """alpha = 0.05 (extreme): a site's largest class holds most of it (IID: about 0.1 with 10 classes)."""
    y = labels(20000, classes=10)
    parts = partition(PartitionSpec(kind="label_skew", n_sites=5, alpha=0.05, seed=3), y)
    top_share = [np.bincount(y[p], minlength=10).max() / len(p) for p in parts if len(p)]
    assert np.mean(top_share) > 0.5


def test_label_skew_needs_integer_classes() -> None:
    """Multilabel or regression targets cannot drive label skew: a clear error."""
    spec = PartitionSpec(kind="label_skew", n_sites=2, alpha=1.0)
    with pytest.raises(DataError, match="integer class"):
        partition(spec, np.zeros((10, 3)))
    with pytest.raises(DataError, match="integer class"):
        partition(spec, np.linspace(0, 1, 10))


# --- feature skew (16.3) ---------------------------------------------------------------------------------


def test_feature_skew_examples() -> None:
    """16.3 examples: ages with K = 3, and 1..7 plus 100 with K = 2."""
    assert as_sets(feature_intervals(AGES, 3), AGES) == [[18, 25, 33], [47, 52, 61], [70, 85]]
    assert as_sets(feature_samples(AGES, 3), AGES) == [[18, 25], [33, 47, 52], [61, 70, 85]]
    skewed = np.array([1, 2, 3, 4, 5, 6, 7, 100], dtype=float)
    assert [len(p) for p in feature_intervals(skewed, 2)] == [7, 1]
    assert [len(p) for p in feature_samples(skewed, 2)] == [4, 4]


def test_even_intervals_boundaries_go_up_and_max_is_closed() -> None:
    """Interior boundaries belong to the upper interval (also after float division); max is in the last."""
    x = np.array([0.0, 0.3, 0.6, 0.9])
    assert as_sets(feature_intervals(x, 3), x) == [[0.0], [0.3], [0.6, 0.9]]
    assert feature_intervals(np.array([5.0, 5.0]), 3)[0].tolist() == [0, 1]


def test_even_samples_is_stable_and_may_split_ties() -> None:
    """Stable sort: equal values keep item order, and a tie can straddle a cut."""
    parts = feature_samples(np.array([1.0, 1.0, 1.0, 1.0, 0.0]), 2)
    assert [p.tolist() for p in parts] == [[4, 0], [1, 2, 3]]


def test_feature_skew_via_spec_and_missing_values() -> None:
    """partition() by a named feature; items with a missing value are spread over the sites, none lost."""
    values = np.array([18, 25, np.nan, 33, 47, 52, np.nan, 61, 70, 85])
    spec = PartitionSpec(kind="feature_intervals", n_sites=3, column="age", seed=1)
    parts = partition(spec, None, features={"age": values})
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))
    present = [sorted(v for v in values[p] if np.isfinite(v)) for p in parts]
    assert present == [[18, 25, 33], [47, 52, 61], [70, 85]]
    with pytest.raises(DataError, match="no feature column 'bmi'"):
        partition(spec.model_copy(update={"column": "bmi"}), None, features={"age": values})


def test_pick_feature_uses_absolute_correlation() -> None:
    """16.3 DECISION: |r|; a strongly negative feature counts as the largest, noise as the smallest."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 500).astype(float)
    feats = {"noise": rng.normal(size=500), "neg": -3 * y + rng.normal(0, 0.5, 500),
             "pos": y + rng.normal(0, 2, 500)}
    assert pick_feature(feats, y, largest=True) == "neg"
    assert pick_feature(feats, y, largest=False) == "noise"
    spec = PartitionSpec(kind="feature_samples", n_sites=2, column="auto_max")
    parts = partition(spec, y.astype(int), features=feats)
    assert np.all(feats["neg"][parts[0]].max() <= feats["neg"][parts[1]].min())


# --- common rules: determinism, coverage, cap (16, 19.1 item 18) ------------------------------------------


KINDS = [
    PartitionSpec(kind="iid", n_sites=4, seed=5),
    PartitionSpec(kind="label_skew", n_sites=4, alpha=0.3, seed=5),
    PartitionSpec(kind="quantity_skew", n_sites=4, alpha=0.3, seed=5),
    PartitionSpec(kind="feature_intervals", n_sites=4, column="f", seed=5),
    PartitionSpec(kind="feature_samples", n_sites=4, column="f", seed=5),
]


@pytest.mark.parametrize("spec", KINDS, ids=lambda s: s.kind)
def test_deterministic_and_every_index_once(spec: PartitionSpec) -> None:
    """Same seed, same split; every index exactly once; sorted int64 arrays."""
    y = labels(997)
    feats = {"f": np.random.default_rng(1).normal(size=997)}
    first = partition(spec, y, features=feats)
    again = partition(spec, y, features=feats)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert np.array_equal(np.sort(np.concatenate(first)), np.arange(997))
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in first if len(p) > 1)


@pytest.mark.parametrize("spec", KINDS[:3], ids=lambda s: s.kind)
def test_another_seed_gives_another_split(spec: PartitionSpec) -> None:
    """The seed drives every random draw."""
    y = labels(997)
    a = partition(spec, y)
    b = partition(spec.model_copy(update={"seed": 6}), y)
    assert any(not np.array_equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize(("spec", "expected"), [
    (PartitionSpec(kind="label_skew", n_sites=3, alpha=1.0, seed=42), [[0], [6, 8], [1, 2, 3, 4, 5, 7, 9]]),
    (PartitionSpec(kind="quantity_skew", n_sites=3, alpha=1.0, seed=42), [[0, 5], [6, 7, 8], [1, 2, 3, 4, 9]]),
    (PartitionSpec(kind="iid", n_sites=3, cap=3, seed=42), [[0, 5, 6], [2, 3, 7], [1, 8, 9]]),
], ids=["label_skew", "quantity_skew", "iid_capped"])  # fmt: skip
def test_golden_splits(spec: PartitionSpec, expected: list[list[int]]) -> None:
    """Pinned outputs: a change in the order of random draws would silently change published manifests."""
    y = np.array([0, 1, 0, 1, 0, 1, 0, 1, 2, 2])
    assert [p.tolist() for p in partition(spec, y)] == expected


def test_iid_sizes_are_equal_within_one() -> None:
    """IID: a shuffle cut into equal pieces."""
    sizes = [len(p) for p in partition(PartitionSpec(kind="iid", n_sites=7, seed=0), labels(1000))]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1000


def test_cap_subsamples_last() -> None:
    """The cap keeps a random subset of the uncapped part, so sites above it end with exactly `cap`."""
    y = labels(3000, classes=2)
    spec = PartitionSpec(kind="label_skew", n_sites=6, alpha=0.5, seed=4)
    full = partition(spec, y)
    capped = partition(spec.model_copy(update={"cap": 300}), y)
    for f, c in zip(full, capped, strict=True):
        assert len(c) == min(len(f), 300) and set(c.tolist()) <= set(f.tolist())
    again = partition(spec.model_copy(update={"cap": 300}), y)
    assert all(np.array_equal(a, b) for a, b in zip(capped, again, strict=True))


def test_milasheuski_setting_most_sites_hit_the_cap() -> None:
    """16 DECISION: oversampled stroke (~2 x 4861 rows), 6 sites, cap 500: most sites end with exactly 500."""
    y = np.array([0] * 4861 + [1] * 4861)
    parts = partition(PartitionSpec(kind="label_skew", n_sites=6, alpha=0.5, cap=500, seed=0), y)
    assert sum(len(p) == 500 for p in parts) >= 4 and max(len(p) for p in parts) == 500


# --- natural, levels, spec validation ---------------------------------------------------------------------


def test_natural_partition_by_group_column() -> None:
    """One site per distinct value, sorted, named as site ids; n_sites must match when given."""
    groups = np.array(["Urban", "Rural", "Urban", "PTB-XL", "Rural"], dtype=object)
    spec = PartitionSpec(kind="natural", column="Residence_type")
    assert [p.tolist() for p in partition(spec, None, groups=groups)] == [[3], [1, 4], [0, 2]]
    assert site_names_for(spec, groups) == ["ptb-xl", "rural", "urban"]
    assert site_name("Govt_job") == "govt-job" and site_name(3) == "3"
    with pytest.raises(DataError, match="3 groups"):
        partition(spec.model_copy(update={"n_sites": 2}), None, groups=groups)


@pytest.mark.parametrize(("alpha", "level"), [
    (0.05, "extreme"), (0.1, "high"), (0.29, "high"), (0.3, "high/medium"), (0.5, "medium"),
    (0.7, "low"), (9.99, "low"), (10, "homogeneous"), (1e6, "homogeneous"),
])  # fmt: skip
def test_heterogeneity_levels(alpha: float, level: str) -> None:
    """16.4 (Milasheuski et al., Table II): the level of a Dirichlet alpha, lower bounds inclusive."""
    assert heterogeneity_level(alpha) == level


@pytest.mark.parametrize(("fields", "message"), [
    ({"kind": "iid"}, "needs n_sites"),
    ({"kind": "label_skew", "n_sites": 3}, "needs alpha"),
    ({"kind": "feature_samples", "n_sites": 3}, "needs column"),
    ({"kind": "natural"}, "needs column"),
    ({"kind": "iid", "n_sites": 3, "cap": 0}, "greater than or equal to 1"),
    ({"kind": "iid", "n_sites": 3, "bogus": 1}, "Extra inputs"),
])  # fmt: skip
def test_partition_spec_validation(fields: dict[str, object], message: str) -> None:
    """Missing parameters are rejected when the spec is built, not halfway through a split."""
    with pytest.raises(ValueError, match=message):
        PartitionSpec.model_validate(fields)


# --- histograms and the manifest -------------------------------------------------------------------------


def test_label_histograms_per_task() -> None:
    """Class counts; per-label positives (NaN = not annotated); LoS bins; unlabelled items not counted."""
    parts = [np.array([0, 1, 2]), np.array([3, 4])]
    assert label_histograms(np.array([0, 2, 2, 1, -1]), parts, TaskInfo("multiclass", 3)) == [
        {"0": 1, "1": 0, "2": 2}, {"0": 0, "1": 1, "2": 0}]
    multi = np.array([[1, 0], [1, np.nan], [0, 1], [1, 1], [np.nan, np.nan]], dtype=np.float32)
    assert label_histograms(multi, parts) == [{"0": 2, "1": 1}, {"0": 1, "1": 1}]
    los = np.array([0.5, 1.0, 20.0, np.nan, 7.99], dtype=np.float32)
    hist = label_histograms(los, parts)
    assert hist[0]["0"] == 1 and hist[0]["1"] == 1 and hist[0]["9"] == 1 and sum(hist[1].values()) == 1


def test_manifest_round_trip_and_recruit_reads_it(tmp_path: Path) -> None:
    """The manifest keeps spec, source and per-site indices and histograms; `fedmqtt recruit` can read it."""
    from fedmqtt.cli.recruit import manifest_reports

    y = labels(200, classes=3)
    spec = PartitionSpec(kind="label_skew", n_sites=3, alpha=0.5, seed=1)
    parts = partition(spec, y)
    hists = label_histograms(y, parts)
    path = tmp_path / "out" / "partition.json"
    write_partition_manifest(path, spec, parts, hists, {"format": "table", "n_items": 200})
    manifest = read_partition_manifest(path)
    assert manifest.spec == spec and manifest.source["n_items"] == 200
    assert [s.site for s in manifest.sites] == ["site-0", "site-1", "site-2"]
    assert np.array_equal(manifest.site_indices("site-1"), parts[1])
    hist_vectors, sizes = manifest_reports(path)
    assert sizes == {f"site-{k}": len(p) for k, p in enumerate(parts)}
    assert hist_vectors["site-0"] == [float(v) for v in hists[0].values()]
    assert len(path.read_text().splitlines()) < 60  # indices stay on one line per site
    with pytest.raises(DataError, match="no site 'site-9'"):
        manifest.site_indices("site-9")


def test_manifest_errors_name_the_file(tmp_path: Path) -> None:
    """A broken or foreign manifest is a DataError naming the file; mismatched inputs are refused."""
    bad = tmp_path / "partition.json"
    bad.write_text(json.dumps({"sites": []}))
    with pytest.raises(DataError, match="partition.json: not a valid partition manifest"):
        read_partition_manifest(bad)
    with pytest.raises(DataError, match="cannot read"):
        read_partition_manifest(tmp_path / "absent.json")
    spec = PartitionSpec(kind="iid", n_sites=2)
    with pytest.raises(DataError, match="do not match"):
        write_partition_manifest(bad, spec, [np.arange(2)], [{}, {}], {})
