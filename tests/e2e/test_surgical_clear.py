"""FedFBN's surgical output layer in the clear, over a real broker and real processes: two hospitals each annotate
3 of 5 labels (a partial-label partition of a small multi-label image set); each names its label set in its
update, and the PS averages row r of the output layer over the sites that annotate label r only. A label one site
annotates ends as that site's row, not the mean with the other site's untrained row. `fedmqtt simulate` on the
same data and seed ends with the same weights, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from harness import FAST_TRAIN
from safetensors.numpy import load_file

from fedmqtt.config_io import dump_toml, read_toml
from fedmqtt.data.partitioners import (
    PartitionSpec,
    label_histograms,
    partition,
    read_partition_manifest,
    write_partition_manifest,
)
from fedmqtt.data.registry import labels_digest, load_dataset
from fedmqtt.data.spec import DataSpec
from fedmqtt.simulation import SimulationConfig, run_simulation
from schemas import messages as m
from schemas.codec import decode
from schemas.tensors import blobs_to_arrays

pytestmark = pytest.mark.e2e
SITES = ("cleveland", "hungary")  # the federation's ids; their data are parts site-0 and site-1 of the partition
LABELS = 5
MODEL = {"name": "lenet5", "args": {"n_classes": LABELS, "norm": "bn"}}
HEAD = ("head.weight", "head.bias")


def _partial_label_data(folder: Path) -> dict[str, DataSpec]:
    """A ChestMNIST-like pooled file (5 labels) and a partition in which each site annotates 3 of them."""
    rng = np.random.default_rng(4)
    pooled = folder / "chest.npz"
    arrays = {}
    for split, n in (("train", 48), ("val", 12), ("test", 12)):
        arrays[f"{split}_images"] = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 2, size=(n, LABELS), dtype=np.uint8)
    np.savez(pooled, **arrays)
    spec = DataSpec(format="medmnist", path=pooled)
    data = load_dataset(spec)
    plan = PartitionSpec(kind="iid", n_sites=len(SITES), labels_per_site=3, seed=0)
    parts = partition(plan, data.class_labels(), n_items=len(data))
    source = {"format": "medmnist", "path": str(pooled), "options": {}, "n_items": len(data),
              "labels_sha256": labels_digest(data.y), "task": data.task.kind}
    manifest = folder / "partition.json"
    write_partition_manifest(manifest, plan, parts, label_histograms(data.y, parts, data.task), source)
    return {s: spec.model_copy(update={"partition": manifest, "site": f"site-{k}"}) for k, s in enumerate(SITES)}


def _stored_update(fed, site: str) -> m.ClientUpdate:  # noqa: ANN001
    (path,) = (fed.work / "state" / site / "uplink").glob("update-r000001-*.msgpack")
    update = decode(path.read_bytes())
    assert isinstance(update, m.ClientUpdate)
    return update


def test_a_clear_surgical_round_averages_each_output_row_over_the_sites_that_annotate_it(cli_federation,
                                                                                        tmp_path) -> None:  # noqa: ANN001
    # Prepare: the sites' data are their parts of the partial-label partition
    specs = _partial_label_data(tmp_path)
    parts = {part.site: tuple(part.annotated) for part in read_partition_manifest(specs[SITES[0]].partition).sites}
    annotated = {s: parts[f"site-{k}"] for k, s in enumerate(SITES)}
    assert sorted(set(annotated[SITES[0]]) & set(annotated[SITES[1]])) == [2]  # one label shared, two each alone
    fed = cli_federation("fbn-clear", run_id="e2e-fbn-clear", rounds=1, sites=SITES, algorithm="fedfbn",
                         model=MODEL, train=FAST_TRAIN, share_label_histogram=True)
    for site in SITES:
        config = read_toml(fed.site_configs[site])
        config["data"] = specs[site].model_dump(mode="json", exclude_defaults=True)
        fed.site_configs[site].write_text(dump_toml(config))
    # Execute
    fed.run_to_completion(240)
    sim = SimulationConfig(run_id="e2e-fbn-clear", algorithm="fedfbn", rounds=1, seed=0, out_dir=tmp_path / "sim",
                           model=MODEL, train=FAST_TRAIN, sites=specs)
    run_simulation(sim, progress=False)
    # Assert: each site named the labels its data annotate, and the PS took them
    updates = {site: _stored_update(fed, site) for site in SITES}
    for site in SITES:
        assert updates[site].label_set == annotated[site]
        assert f"this site annotates 3 of {LABELS} labels" in fed.tail(site, 400)
    assert "refused" not in fed.tail("ps", 400)
    trained = {site: blobs_to_arrays(updates[site].tensors) for site in SITES}
    final = fed.final_weights()
    for name in HEAD:
        for r in range(LABELS):
            holders = [s for s in SITES if r in annotated[s]]
            want = np.mean([trained[s][name][r].astype(np.float64) for s in holders], axis=0).astype(np.float32)
            np.testing.assert_allclose(final[name][r], want, rtol=0, atol=1e-7, err_msg=f"{name} row {r}")
            if len(holders) == 1:  # the plain mean (the old, silent behaviour) would differ visibly here
                plain = np.mean([trained[s][name][r].astype(np.float64) for s in SITES], axis=0)
                assert np.max(np.abs(final[name][r] - plain)) > 1e-4, (name, r)
    body = [n for n in trained[SITES[0]] if n not in HEAD and trained[SITES[0]][n].dtype.kind == "f"]
    for name in body:
        plain = np.mean([trained[s][name].astype(np.float64) for s in SITES], axis=0)
        np.testing.assert_allclose(final[name], plain, rtol=0, atol=1e-6, err_msg=name)
    # ... and the simulation, with the same label sets, ends with the same weights bit for bit
    simulated = load_file(str(tmp_path / "sim" / "final_model.safetensors"))
    assert sorted(simulated) == sorted(final)
    for name in final:
        np.testing.assert_array_equal(final[name], simulated[name], err_msg=name)
