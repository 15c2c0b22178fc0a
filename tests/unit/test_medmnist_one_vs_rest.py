"""MedMNIST for FedFBN's setting: a single-label file as one-vs-rest labels that a partition can leave partly
unannotated per site, and grey/colour channels matched to a model pretrained on the other kind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_partial_labels import write_manifest

from fedmqtt.data.medmnist import LUMA_BT601, match_channels
from fedmqtt.data.partition_job import prepare_job
from fedmqtt.data.partitioners import PartitionSpec, annotated_labels, read_partition_manifest
from fedmqtt.data.registry import load_dataset, load_site_data
from fedmqtt.data.spec import DataSpec
from fedmqtt.errors import ConfigError, DataError

CLASSES = 4


def organ_like_npz(path: Path, *, colour: bool = False, classes: int = CLASSES) -> Path:
    """A small OrganAMNIST-like file (grey, one class per image) or BloodMNIST-like (colour)."""
    rng = np.random.default_rng(2)
    arrays = {}
    for split, n in (("train", 48), ("val", 12), ("test", 12)):
        shape = (n, 28, 28, 3) if colour else (n, 28, 28)
        arrays[f"{split}_images"] = rng.integers(0, 256, size=shape, dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % classes).reshape(n, 1).astype(np.uint8)
    np.savez(path, **arrays)
    return path


def test_one_vs_rest_turns_each_class_into_its_own_label(tmp_path: Path) -> None:
    # Prepare
    path = organ_like_npz(tmp_path / "organ.npz")
    plain = load_dataset(DataSpec(format="medmnist", path=path))
    # Execute
    ovr = load_dataset(DataSpec(format="medmnist", path=path, options={"targets": "one_vs_rest"}))
    # Assert
    assert plain.task.kind == "multiclass" and ovr.task.kind == "multilabel"
    assert ovr.task.n_outputs == CLASSES and ovr.task.label_names == plain.task.label_names
    assert ovr.y.dtype == np.float32 and ovr.y.shape == (len(plain), CLASSES)
    np.testing.assert_array_equal(ovr.y.argmax(axis=1), plain.y)
    assert (ovr.y.sum(axis=1) == 1).all()
    assert any("one-vs-rest" in note for note in ovr.notes)


def test_sites_annotate_only_their_share_of_the_classes(tmp_path: Path) -> None:
    """The per-site masks of the partial-label data (labels_per_site), now on a single-label file."""
    # Prepare
    pooled = DataSpec(format="medmnist", path=organ_like_npz(tmp_path / "organ.npz"),
                      options={"targets": "one_vs_rest"})
    spec = PartitionSpec(kind="iid", n_sites=2, labels_per_site=3, seed=1)
    manifest = read_partition_manifest(write_manifest(tmp_path, pooled, spec))
    # Execute / Assert
    for part, annotated in zip(manifest.sites, annotated_labels(CLASSES, 2, 3, seed=1), strict=True):
        site = load_site_data(pooled.model_copy(update={"partition": tmp_path / "partition.json",
                                                        "site": part.site}))
        others = [k for k in range(CLASSES) if k not in annotated]
        assert site.task.kind == "multilabel"
        assert not np.isnan(site.y_train[:, annotated]).any() and np.isnan(site.y_train[:, others]).all()


def test_one_vs_rest_of_a_multilabel_file_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {f"{s}_{k}": v for s, n in (("train", 8), ("val", 4), ("test", 4)) for k, v in (
        ("images", rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)),
        ("labels", rng.integers(0, 2, size=(n, 3), dtype=np.uint8)))}
    np.savez(tmp_path / "chest.npz", **arrays)
    with pytest.raises(DataError, match="needs a single-label file; this one is multilabel"):
        load_dataset(DataSpec(format="medmnist", path=tmp_path / "chest.npz", options={"targets": "one_vs_rest"}))


def test_grey_images_repeat_into_three_channels_and_colour_turns_grey(tmp_path: Path) -> None:
    # Prepare
    grey = organ_like_npz(tmp_path / "organ.npz")
    colour = organ_like_npz(tmp_path / "blood.npz", colour=True)
    as_stored_grey = load_dataset(DataSpec(format="medmnist", path=grey)).x
    as_stored_colour = load_dataset(DataSpec(format="medmnist", path=colour)).x
    # Execute
    three = load_dataset(DataSpec(format="medmnist", path=grey, options={"channels": 3}))
    one = load_dataset(DataSpec(format="medmnist", path=colour, options={"channels": 1}))
    # Assert
    assert three.x.shape[1] == 3 and three.feature_names == ("channel_0", "channel_1", "channel_2")
    for c in range(3):
        np.testing.assert_array_equal(three.x[:, c], as_stored_grey[:, 0])
    assert one.x.shape[1] == 1 and one.x.dtype == np.float32
    expected = (as_stored_colour * LUMA_BT601[None, :, None, None]).sum(axis=1)
    np.testing.assert_allclose(one.x[:, 0], expected, rtol=1e-6)
    assert match_channels(as_stored_grey, 1) is as_stored_grey  # nothing to do


def test_unknown_channel_counts_are_refused_when_the_config_is_read(tmp_path: Path) -> None:
    with pytest.raises((ConfigError, ValueError), match="channels"):
        DataSpec(format="medmnist", path=tmp_path / "x.npz", options={"channels": 2})


def test_fedfbn_proxy_from_a_colour_backbone_to_grey_sites_with_partial_labels(tmp_path: Path) -> None:
    """The whole chain of the FedFBN proxy, small: pretrain LeNet-5 on colour images made grey (8 classes),
    start a FedFBN federation of grey one-vs-rest sites with partial labels (4 labels) from it."""
    from typer.testing import CliRunner

    from fedmqtt.cli import app
    from fedmqtt.simulation import SimulationConfig, run_simulation

    # Prepare: the pretraining config and its file
    blood = organ_like_npz(tmp_path / "blood.npz", colour=True, classes=8)
    (tmp_path / "blood.toml").write_text(f"""
[model]
name = "lenet5"
args = {{ in_channels = 1, n_classes = 8, norm = "bn" }}
[train]
epochs = 1
batch_size = 16
[sites.blood]
format = "medmnist"
path = "{blood}"
options = {{ channels = 1 }}
""")
    pretrained = tmp_path / "blood.safetensors"
    done = CliRunner().invoke(app, ["pretrain", str(tmp_path / "blood.toml"), "--out", str(pretrained),
                                    "--epochs", "1"])
    assert done.exit_code == 0, done.output
    pooled = DataSpec(format="medmnist", path=organ_like_npz(tmp_path / "organ.npz"),
                      options={"targets": "one_vs_rest"})
    manifest = write_manifest(tmp_path, pooled, PartitionSpec(kind="iid", n_sites=2, labels_per_site=2, seed=0))
    sites = {part.site: pooled.model_copy(update={"partition": manifest, "site": part.site})
             for part in read_partition_manifest(manifest).sites}
    config = SimulationConfig(run_id="proxy", algorithm="fedfbn", rounds=1, out_dir=tmp_path / "sim", sites=sites,
                              model={"name": "lenet5", "args": {"in_channels": 1, "n_classes": CLASSES,
                                                                "norm": "bn"}},
                              train={"epochs": 1, "batch_size": 16, "lr": 0.01, "loss": "bce"},
                              init_model={"path": pretrained, "tensors": "matching"})
    # Execute
    report = run_simulation(config, progress=False)
    # Assert: everything but the 8-class head came from the pretraining, BatchNorm's statistics included
    init = report["init_model"]
    assert init["kept"] == ["head.weight", "head.bias"]
    assert any("running_mean" in name for name in init["loaded"])
    assert set(init["ignored"]) == {"head.weight", "head.bias"}
    assert all("auroc" in e["metrics"]["test"] for e in report["final"]["per_site"].values())


@pytest.mark.parametrize("kind", ["label_skew", "quantity_skew", "adafed_pairs"])
def test_label_based_partitioners_split_one_vs_rest_data_as_the_single_label_file(tmp_path: Path, kind: str) -> None:
    """Every row of one-vs-rest data has one positive: its class, so label skew splits it (it used to refuse
    multi-label data) into the same sites, item for item, as the file's own classes, with per-site masks."""
    # Prepare
    path = organ_like_npz(tmp_path / "organ.npz")
    plain = DataSpec(format="medmnist", path=path)
    ovr = DataSpec(format="medmnist", path=path, options={"targets": "one_vs_rest"})
    spec = PartitionSpec(kind=kind, n_sites=4, alpha=0.3, labels_per_site=2, seed=5)
    # Execute: as `fedmqtt partition` and a grid's partition axis run it
    plain_job = prepare_job(plain, spec.model_copy(update={"labels_per_site": None}))
    by_class = read_partition_manifest(plain_job.run(tmp_path / "plain").manifest)
    by_label = read_partition_manifest(prepare_job(ovr, spec).run(tmp_path / "ovr").manifest)
    # Assert
    assert [p.indices for p in by_label.sites] == [p.indices for p in by_class.sites]
    for part in by_label.sites:
        assert part.annotated is not None and len(part.annotated) == 2
        kept = {str(k) for k in part.annotated}
        plain_counts = next(p.histogram for p in by_class.sites if p.site == part.site)
        assert part.histogram == {k: (c if k in kept else 0) for k, c in plain_counts.items()}


def test_multilabel_rows_without_exactly_one_positive_give_no_class_to_split_by() -> None:
    from fedmqtt.data.registry import one_positive_per_row

    assert one_positive_per_row(np.eye(3, dtype=np.float32)[[0, 2, 1, 1]])
    assert not one_positive_per_row(np.array([[1, 0], [1, 1]], dtype=np.float32))  # two diagnoses
    assert not one_positive_per_row(np.array([[1, 0], [0, 0]], dtype=np.float32))  # none
    assert not one_positive_per_row(np.array([[1, np.nan], [0, 1]], dtype=np.float32))  # unknown
    assert not one_positive_per_row(np.array([[0.5, 0.5]], dtype=np.float32))
    assert not one_positive_per_row(np.zeros((0, 3), dtype=np.float32))
