"""Partial labels (issue 13, item 7): a partition in which each site annotates only some of the labels;
the others reach the site as NaN (unknown), and the masked loss and metrics leave them out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedmqtt.data.partitioners import (
    PartitionSpec,
    annotated_labels,
    label_histograms,
    partition,
    read_partition_manifest,
    write_partition_manifest,
)
from fedmqtt.data.registry import labels_digest, load_dataset, load_site_data
from fedmqtt.data.spec import DataSpec
from fedmqtt.errors import DataError
from fedmqtt.training.loop import make_loss

N_LABELS = 5


@pytest.mark.parametrize(("n_labels", "n_sites", "per_site"), [(6, 3, 4), (5, 3, 2), (26, 4, 7), (3, 5, 1)])
def test_every_label_is_annotated_somewhere_and_sites_hold_distinct_labels(
        n_labels: int, n_sites: int, per_site: int) -> None:
    sets = annotated_labels(n_labels, n_sites, per_site, seed=3)
    assert len(sets) == n_sites
    assert all(len(set(s)) == per_site and all(0 <= k < n_labels for k in s) for s in sets)
    covered = {k for s in sets for k in s}
    assert len(covered) == min(n_labels, n_sites * per_site)
    assert annotated_labels(n_labels, n_sites, per_site, seed=3) == sets  # seeded


def test_seeds_give_other_assignments_and_too_many_labels_is_refused() -> None:
    assert len({tuple(map(tuple, annotated_labels(10, 3, 3, seed=s))) for s in range(6)}) > 1
    with pytest.raises(DataError, match="only 4 labels"):
        annotated_labels(4, 2, 5, seed=0)


def multilabel_npz(path: Path) -> Path:
    """A small ChestMNIST-like file: 5 labels, every label positive in about half the images."""
    rng = np.random.default_rng(1)
    arrays = {}
    for split, n in (("train", 40), ("val", 10), ("test", 10)):
        arrays[f"{split}_images"] = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 2, size=(n, N_LABELS), dtype=np.uint8)
    np.savez(path, **arrays)
    return path


def write_manifest(tmp_path: Path, pooled: DataSpec, spec: PartitionSpec) -> Path:
    data = load_dataset(pooled)
    parts = partition(spec, data.class_labels(), n_items=len(data))
    source = {"format": pooled.format, "path": str(pooled.path), "options": {}, "n_items": len(data),
              "labels_sha256": labels_digest(data.y), "task": data.task.kind}
    path = tmp_path / "partition.json"
    write_partition_manifest(path, spec, parts, label_histograms(data.y, parts, data.task), source)
    return path


def test_sites_see_only_their_labels(tmp_path: Path) -> None:
    pooled = DataSpec(format="medmnist", path=multilabel_npz(tmp_path / "chest.npz"))
    spec = PartitionSpec(kind="iid", n_sites=3, labels_per_site=2, seed=5)
    manifest = read_partition_manifest(write_manifest(tmp_path, pooled, spec))
    expected = annotated_labels(N_LABELS, 3, 2, seed=5)
    full = load_dataset(pooled).y
    for part, annotated in zip(manifest.sites, expected, strict=True):
        assert part.annotated == annotated
        positives = full[np.asarray(part.indices)][:, annotated].sum(axis=0)
        assert part.histogram == {str(k): int(positives[annotated.index(k)]) if k in annotated else 0
                                  for k in range(N_LABELS)}
        site = load_site_data(pooled.model_copy(update={"partition": tmp_path / "partition.json",
                                                        "site": part.site}))
        for y in (site.y_train, site.y_val, site.y_test):
            assert not np.isnan(y[:, annotated]).any()
            others = [k for k in range(N_LABELS) if k not in annotated]
            assert np.isnan(y[:, others]).all()
        assert any("annotating labels" in note for note in site.notes)


def test_partial_labels_need_multilabel_data(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {f"{s}_{k}": v for s, n in (("train", 12), ("val", 4), ("test", 4)) for k, v in (
        ("images", rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)),
        ("labels", rng.integers(0, 2, size=(n, 1), dtype=np.uint8)))}
    np.savez(tmp_path / "pneu.npz", **arrays)
    pooled = DataSpec(format="medmnist", path=tmp_path / "pneu.npz")
    with pytest.raises(DataError, match="multi-label"):
        write_manifest(tmp_path, pooled, PartitionSpec(kind="iid", n_sites=2, labels_per_site=1))


def test_masked_loss_ignores_unannotated_labels() -> None:
    """The loss of a site that annotates labels {0, 2} does not depend on the outputs for labels 1, 3, 4."""
    y = torch.tensor([[1.0, np.nan, 0.0, np.nan, np.nan], [0.0, np.nan, 1.0, np.nan, np.nan]])
    logits = torch.zeros(2, N_LABELS, requires_grad=True)
    loss = make_loss("bce")(logits, y)
    loss.backward()
    assert logits.grad is not None
    assert torch.all(logits.grad[:, [1, 3, 4]] == 0) and torch.all(logits.grad[:, [0, 2]] != 0)
    assert loss.item() == pytest.approx(np.log(2.0))
