"""One partition job, as `fedmqtt partition` and a grid's partition axis run it: read the pooled dataset,
settle the column the partition uses, split the items into sites, count each site's labels, and write the
manifest (partition.json) with its bubble plot (partition.png) into one folder.

It runs in two steps, `prepare_job` then `PartitionJob.run`, so that a caller can say which feature an
auto_max / auto_min rule picked before the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedmqtt.data import partitioners as pt
from fedmqtt.data.base import TaskInfo
from fedmqtt.data.partition_view import plot_partition
from fedmqtt.data.spec import DataSpec
from fedmqtt.errors import DataError

if TYPE_CHECKING:  # the registry pulls in every format's reader: imported when a job loads its data
    from fedmqtt.data.registry import Dataset

MANIFEST_FILE = "partition.json"
PLOT_FILE = "partition.png"


@dataclass(frozen=True)
class SitePartition:
    """What a job wrote: the spec as in the manifest, each site's name, items and label counts, and where."""

    spec: pt.PartitionSpec
    names: list[str]
    parts: list[np.ndarray]
    histograms: list[dict[str, int]]
    task: TaskInfo
    n_items: int  # items in the pooled dataset
    manifest: Path
    plot: Path


@dataclass(frozen=True)
class PartitionJob:
    """A partition spec over its loaded pooled dataset, with the column settled.

    `spec.column` is the feature an auto_max / auto_min rule picked (`rule`), so that the manifest reads
    without the rule; `groups` holds the site column's values of a natural partition.
    """

    pooled: DataSpec
    data: Dataset
    spec: pt.PartitionSpec
    groups: np.ndarray | None
    rule: str | None

    def run(self, out_dir: Path, *, title: str | None = None) -> SitePartition:
        """Split, count labels, write OUT_DIR/partition.json and OUT_DIR/partition.png (titled `title`, by
        default the kind with its parameters and seed)."""
        data, spec, groups = self.data, self.spec, self.groups
        parts = pt.partition(spec, data.class_labels(), features=data.features, groups=groups, n_items=len(data))
        names = pt.site_names_for(spec, groups)
        hists = pt.label_histograms(data.y, parts, data.task)
        manifest, plot = Path(out_dir) / MANIFEST_FILE, Path(out_dir) / PLOT_FILE
        pt.write_partition_manifest(manifest, spec, parts, hists, self._source(), site_names=names)
        plot_partition(names, hists, plot, title=describe(spec) if title is None else title,
                       task_kind=data.task.kind)
        return SitePartition(spec=spec, names=names, parts=parts, histograms=hists, task=data.task,
                             n_items=len(data), manifest=manifest, plot=plot)

    def _source(self) -> dict[str, Any]:
        """The manifest's record of the pooled dataset: a site checks its data against it before loading."""
        from fedmqtt.data.registry import labels_digest

        pooled, data = self.pooled, self.data
        return {"format": pooled.format, "path": str(pooled.path), "options": dict(pooled.options),
                "n_items": len(data), "labels_sha256": labels_digest(data.y), "task": data.task.kind,
                "label_names": list(data.task.label_names), **({"column_rule": self.rule} if self.rule else {})}


def prepare_job(pooled: DataSpec, spec: pt.PartitionSpec, *, dataset: str = "this dataset") -> PartitionJob:
    """Load the pooled dataset and settle `spec`'s column.

    Raises:
        DataError: a natural partition's site column is not in the dataset (`dataset` names it in the
            message), or the dataset cannot be read.
    """
    from fedmqtt.data.registry import load_dataset

    data = load_dataset(pooled)
    if spec.kind == "natural":
        column = str(spec.column)
        if column not in data.groups:
            raise DataError(f"no site column {spec.column!r} in {dataset}; "
                            f"columns: {', '.join(data.groups) or '(none)'}")
        return PartitionJob(pooled, data, spec, data.groups[column], None)
    if spec.column in (pt.AUTO_MAX, pt.AUTO_MIN):
        rule = spec.column
        labels = data.class_labels()
        if labels is None:  # regression and multi-label data: correlate with the label values themselves
            labels = data.y
        picked = pt.pick_feature(data.features, labels, largest=rule == pt.AUTO_MAX)
        return PartitionJob(pooled, data, spec.model_copy(update={"column": picked}), None, rule)
    return PartitionJob(pooled, data, spec, None, None)


def describe(spec: pt.PartitionSpec) -> str:
    """The kind with its parameters and seed, e.g. "label_skew (alpha=0.5, cap=500, seed=0)"."""
    params = [f"{k}={v}" for k, v in (("alpha", spec.alpha), ("column", spec.column), ("cap", spec.cap)) if v]
    return f"{spec.kind} ({', '.join([*params, f'seed={spec.seed}'])})"
