"""From a DataSpec to a site's normalised SiteData, whatever the format (its own statistics or the federation's).

Per site: read the file(s), values outside a column's plausible range set to missing (tables' feature spec,
PhysioNet 2012's options; fedmqtt.data.plausible); keep the manifest's items when a partition is given; drop
unlabelled items (docs/algorithms.md 17.1); split train/val/test (`fractions`, `split_seed`; stratified by class
for binary and multiclass, plain random for multilabel and regression); clip every split of tables and ICU
channels to the train split's robust bounds (fedmqtt.data.splits.clip_bounds); fill missing values with the
train median and standardise with the train mean/std, per feature (tables), per colour channel (images) or per
channel over all hours (ICU; mask channels untouched). A channel constant or entirely missing in this site's train
split is 0 in every split (fedmqtt.data.splits: relative std floor; docs/data-preparation.md). ECG
records are standardised per record and lead by the adapter. With `statistics` (a federation's statistics file),
tables and ICU stays are clipped, filled and standardised with those instead (fedmqtt.data.feature_stats), and
`site_train_summary` gives the sums a site contributes to them.

ICU length of stay: Scheltjens et al. used one global train/val/test split; here every site splits its own stays
with the same fractions, so the union of the sites' test splits is a site-stratified global test split of
the same size, and pooled test metrics come from the sites' test predictions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedmqtt.data.base import BINARY, TaskInfo
from fedmqtt.data.feature_stats import Grid, Summary, column_grid, standardise_with, summarise
from fedmqtt.data.feature_wire import read_statistics
from fedmqtt.data.partitioners import PartitionManifest, read_partition_manifest
from fedmqtt.data.plausible import remove_out_of_range, removed_note
from fedmqtt.data.read_once import freeze_arrays, read_once
from fedmqtt.data.spec import DataSpec
from fedmqtt.data.splits import (
    SiteData,
    clip,
    clip_bounds,
    clipped_note,
    constant_columns,
    is_constant,
    split_and_normalise,
    split_indices,
    standardise,
    train_statistics,
    warn_extreme,
)
from fedmqtt.errors import DataError

Layout = Literal["table", "image", "ecg", "icu"]


@dataclass(frozen=True)
class Dataset:
    """A whole dataset as its adapter reads it, before any split; items on axis 0, raw values (NaN = missing).

    y: int64 classes (-1 = unlabelled), float32 (n, k) multilabel (NaN = not annotated), or float32
    regression (NaN = unlabelled). groups: candidate natural site keys; features: numeric covariates for
    feature skew; fixed: channels left as they are by normalisation (ICU masks).
    """

    x: np.ndarray
    y: np.ndarray
    task: TaskInfo
    feature_names: tuple[str, ...]
    layout: Layout
    groups: Mapping[str, np.ndarray] = field(default_factory=dict)
    features: Mapping[str, np.ndarray] = field(default_factory=dict)
    fixed: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    # Per item, per column: values outside the column's plausible range, already set to NaN in x
    # (fedmqtt.data.plausible); a site's notes count its own items' only.
    removed: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def class_labels(self) -> np.ndarray | None:
        """One integer class per item for label-based partitioners, or None (regression, multi-label data).

        One-vs-rest data (MedMNIST's targets = "one_vs_rest": every row one 1 and zeros, nothing unknown) is
        a single-label task underneath, so its rows give the class of their positive: label skew and
        quantity skew split it as they split the single-label file, item for item.
        """
        if self.task.kind in ("binary", "multiclass"):
            return self.y
        if self.task.kind == "multilabel" and one_positive_per_row(self.y):
            return np.argmax(self.y, axis=1).astype(np.int64)
        return None

    def labelled(self) -> np.ndarray:
        if self.task.kind == "regression":
            return np.isfinite(self.y)
        if self.task.kind == "multilabel":
            return ~np.isnan(self.y).all(axis=1)
        return self.y >= 0


def one_positive_per_row(y: np.ndarray) -> bool:
    """Whether a multi-label matrix holds exactly one 1 per row and zeros elsewhere (no NaN, no other value)."""
    if y.ndim != 2 or y.shape[0] == 0:
        return False
    with np.errstate(invalid="ignore"):
        binary = bool(np.isin(y, (0.0, 1.0)).all())  # NaN is in neither
    return binary and bool((y.sum(axis=1) == 1).all())


def labels_digest(y: np.ndarray) -> str:
    """A fingerprint of a dataset's labels in item order: a manifest made from other data is caught."""
    return hashlib.sha256(np.ascontiguousarray(y).tobytes()).hexdigest()[:16]


def load_dataset(spec: DataSpec) -> Dataset:
    """Read the whole file/folder of `spec` (no partition, no split); inside `read_once.shared_datasets()`
    (a simulation) each file once, read-only."""
    opts = spec.parsed_options()
    loader = {"heart_disease": _heart_disease, "table": _table, "medmnist": _medmnist, "wfdb": _wfdb,
              "physionet2012": _physionet2012}[spec.format]
    return read_once(spec.format, Path(spec.path), opts,
                     lambda: loader(Path(spec.path), opts), _read_only)


def load_site_data(spec: DataSpec, *, dataset: Dataset | None = None) -> SiteData:
    """This site's split and normalised data (see the module docstring for each step).

    `dataset`: what `load_dataset(spec)` returned, when the caller read it already (`fedmqtt site check` counts
    the raw missing values, then goes on exactly as the agent does). With `spec.statistics`, tables and ICU
    stays are clipped, filled and standardised with the federation's statistics (fedmqtt.data.feature_stats)."""
    data, notes, out_of_range = _site_items(spec, dataset)
    if spec.format == "heart_disease" and spec.statistics is None:  # the original path, bit for bit
        site = split_and_normalise(data.x, data.y, seed=spec.split_seed, fractions=spec.fractions,
                                   feature_names=data.feature_names, where=_where(spec))
        return replace(site, notes=(*notes, *site.notes), task=data.task, out_of_range=out_of_range)
    train, val, test, split_notes = _split(spec, data)
    if spec.statistics is not None:
        norm, zeroed = _federation_normaliser(data, spec, notes)
    else:
        norm, zeroed = _normaliser(data, train, {"val": val, "test": test}, notes, _where(spec))
    if zeroed:
        notes.append(f"{_where(spec)}: constant or missing in train, set to 0: {', '.join(zeroed)}")
    x_train = norm(train)
    if data.layout in ("table", "icu"):
        notes.extend(warn_extreme(x_train, data.feature_names, _where(spec)))
    return SiteData(
        x_train=x_train, y_train=data.y[train], x_val=norm(val), y_val=data.y[val],
        x_test=norm(test), y_test=data.y[test], feature_names=data.feature_names,
        notes=(*notes, *split_notes), task=data.task, out_of_range=out_of_range,
    )


@dataclass(frozen=True)
class TrainSummary:
    """What a site contributes to the federation's feature statistics: its training values' sums on the grid
    every site derives from the same spec options, and the channels left as they are (ICU masks)."""

    columns: tuple[str, ...]
    grid: Grid
    summary: Summary
    fixed: tuple[int, ...]
    n_train: int


def site_train_summary(spec: DataSpec, *, dataset: Dataset | None = None) -> TrainSummary:
    """This site's Summary of its training split, the split `load_site_data` makes (same items, same seed).

    Raises:
        DataError: a format without per-column statistics (images, ECG records).
    """
    data, _, _ = _site_items(spec, dataset)
    if data.layout not in ("table", "icu"):
        raise DataError(f"{_where(spec)}: federated feature statistics are for tables and ICU stays, not "
                        f"{data.layout} data")
    train, _, _, _ = _split(spec, data)
    grid = column_grid(data.feature_names, _plausible_ranges(spec))
    return TrainSummary(data.feature_names, grid, summarise(data.x[train], grid), data.fixed, int(train.size))


def _site_items(spec: DataSpec, dataset: Dataset | None) -> tuple[Dataset, list[str], dict[str, int]]:
    """This site's labelled items (its part of a partition), the notes so far and its out-of-range counts."""
    manifest = _read_manifest(spec) if spec.partition is not None else None  # cheap checks first
    data = dataset if dataset is not None else load_dataset(spec)
    notes = list(data.notes)
    if manifest is not None:
        data, note = _select_part(data, spec, manifest)
        notes.append(note)
    keep = data.labelled()
    if not keep.all():
        notes.append(f"dropped {int((~keep).sum())} unlabelled item(s)")
        data = _take(data, np.flatnonzero(keep))
    if (removed := removed_note(data.removed, _where(spec))) is not None:
        notes.append(removed)
    out_of_range = {name: int(counts.sum()) for name, counts in sorted(data.removed.items()) if counts.sum()}
    return data, notes, out_of_range


def _split(spec: DataSpec, data: Dataset) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]:
    stratify = data.task.kind in ("binary", "multiclass")
    return split_indices(data.y, seed=spec.split_seed, fractions=spec.fractions, stratify=stratify)


def _plausible_ranges(spec: DataSpec) -> dict[str, tuple[float, float]]:
    """The columns' plausible ranges the spec applies (the histogram grid follows them); {} when none."""
    opts = spec.parsed_options()
    if spec.format == "physionet2012":
        return dict(opts.ranges)
    if spec.format == "table":
        from fedmqtt.data.tables import resolve_spec

        return dict(resolve_spec(opts.spec).ranges)
    return {}


def _federation_normaliser(data: Dataset, spec: DataSpec, notes: list[str]) -> tuple[Normaliser, list[str]]:
    """Rows -> float32 rows clipped, filled and standardised with the federation's statistics file."""
    if data.layout not in ("table", "icu"):
        raise DataError(f"{_where(spec)}: federated feature statistics are for tables and ICU stays, not "
                        f"{data.layout} data")
    stats = read_statistics(Path(str(spec.statistics)), data.feature_names)
    notes.append(f"{_where(spec)}: clipped, filled and standardised with the federation's statistics "
                 f"({spec.statistics})")

    def norm(rows: np.ndarray) -> np.ndarray:
        return standardise_with(data.x[rows], stats)

    return norm, constant_columns(stats.std, data.feature_names)


def _read_manifest(spec: DataSpec) -> PartitionManifest:
    manifest = read_partition_manifest(Path(str(spec.partition)))
    made_from = manifest.source.get("format")
    if made_from != spec.format:
        raise DataError(f"{spec.partition}: made from format {made_from!r}, this site reads {spec.format!r}")
    manifest.site_indices(str(spec.site))  # an unknown site fails here, naming the manifest's sites
    return manifest


def _select_part(data: Dataset, spec: DataSpec, manifest: PartitionManifest) -> tuple[Dataset, str]:
    src, digest = manifest.source, labels_digest(data.y)
    if src.get("n_items") != len(data) or src.get("labels_sha256", digest) != digest:
        raise DataError(f"{spec.partition}: made from another dataset ({src.get('n_items')} items from "
                        f"{src.get('path')}); {spec.path} has {len(data)} items or other labels in that "
                        "order")
    idx = manifest.site_indices(str(spec.site))
    if idx.size and (idx.min() < 0 or idx.max() >= len(data)):
        raise DataError(f"{spec.partition}: site {spec.site!r} lists indices outside 0..{len(data) - 1}")
    part = _take(data, idx)
    note = f"partition {spec.partition} site {spec.site}: {idx.size} of {len(data)} items"
    annotated = manifest.site_part(str(spec.site)).annotated
    if annotated is None:
        return part, note
    return _mask_labels(part, annotated, str(spec.partition)), f"{note}, annotating labels {annotated}"


def _mask_labels(data: Dataset, annotated: list[int], where: str) -> Dataset:
    """Partial labels: the labels this site does not annotate become unknown (NaN), which the loss and the
    metrics leave out, as if the hospital never looked for those diagnoses."""
    if data.task.kind != "multilabel":
        raise DataError(f"{where}: labels_per_site (partial labels) needs multi-label data; this is "
                        f"{data.task.kind}")
    y = np.array(data.y, dtype=np.float32, copy=True)
    unknown = np.setdiff1d(np.arange(y.shape[1]), np.asarray(annotated, dtype=np.int64))
    y[:, unknown] = np.nan
    return replace(data, y=y)


def _take(data: Dataset, idx: np.ndarray) -> Dataset:
    return replace(data, x=data.x[idx], y=data.y[idx], groups={k: v[idx] for k, v in data.groups.items()},
                   features={k: v[idx] for k, v in data.features.items()},
                   removed={k: v[idx] for k, v in data.removed.items()})


Normaliser = Callable[[np.ndarray], np.ndarray]


def _where(spec: DataSpec) -> str:
    """The site as warnings name it: its partition site, else its file."""
    return f"site {spec.site}" if spec.site is not None else f"site file {spec.path}"


def _normaliser(data: Dataset, train: np.ndarray, held_out: Mapping[str, np.ndarray], notes: list[str],
                where: str) -> tuple[Normaliser, list[str]]:
    """A function rows -> float32 normalised rows from the train rows' statistics only, and the names of
    the channels it sets to 0 because they are constant or entirely missing in train (splits.standardise).

    Tables and ICU stays are clipped first, every split, to the train rows' robust bounds (splits.clip_bounds;
    mask channels excepted); values it moves far (splits.clipped_note) are counted in `notes`."""
    if data.layout == "ecg":  # already standardised per record and lead by the adapter
        return (lambda rows: data.x[rows].astype(np.float32)), []
    if data.layout == "image":  # per colour channel; pixels are never missing
        x_train = data.x[train]
        mean = x_train.mean(axis=(0, 2, 3), dtype=np.float64)
        std = x_train.std(axis=(0, 2, 3), dtype=np.float64)
        flat = is_constant(std, mean)
        zeroed = [data.feature_names[c] for c in np.flatnonzero(flat)]
        scale = np.where(flat, 0.0, 1.0 / np.where(flat, 1.0, std)).astype(np.float32)[None, :, None, None]
        shift = mean.astype(np.float32)[None, :, None, None]
        if not flat.any():  # the usual case, as before: divide by the float32 std
            std32 = std.astype(np.float32)[None, :, None, None]
            return (lambda rows: (data.x[rows] - shift) / std32), []
        return (lambda rows: (data.x[rows] - shift) * scale), zeroed
    # tables (n, f) and ICU stays (n, 48, c): per last-axis channel, NaN filled with the train median
    width = data.x.shape[-1]
    low, high = clip_bounds(data.x[train])
    for c in data.fixed:
        low[c], high[c] = -np.inf, np.inf
    parts = {"train": data.x[train], **{split: data.x[rows] for split, rows in held_out.items()}}
    if (clipped := clipped_note(parts, low, high, where, data.feature_names)) is not None:
        notes.append(clipped)
    fill, mean, std = train_statistics(clip(data.x[train], low, high).reshape(-1, width))
    for c in data.fixed:  # mask channels stay 0/1
        fill[c], mean[c], std[c] = 0.0, 0.0, 1.0

    def norm(rows: np.ndarray) -> np.ndarray:
        return standardise(clip(data.x[rows], low, high), fill, mean, std)

    return norm, constant_columns(std, data.feature_names)


def _heart_disease(path: Path, opts: Any) -> Dataset:
    from fedmqtt.data.heart_disease import FEATURE_NAMES, NUMERIC, load_site_file

    x, y = load_site_file(path)
    feats = {name: x[:, FEATURE_NAMES.index(name)] for name in NUMERIC}
    return Dataset(x, y, BINARY, FEATURE_NAMES, "table", features=feats)


def _table(path: Path, opts: Any) -> Dataset:
    from fedmqtt.data.tables import load_table, read_columns, resolve_spec

    fspec = resolve_spec(opts.spec)
    x, y, names = load_table(path, fspec)
    x, removed = remove_out_of_range(x, names, fspec.ranges)
    groups = read_columns(path, [*fspec.binary, *fspec.categorical, *fspec.drop])
    feats = {name: x[:, names.index(name)] for name in fspec.numeric}
    return Dataset(x, y, fspec.task_info(), names, "table", groups=groups, features=feats, removed=removed)


def _medmnist(path: Path, opts: Any) -> Dataset:
    from fedmqtt.data.medmnist import load_medmnist, match_channels, one_vs_rest

    x, y, task = load_medmnist(path, splits=opts.splits)
    notes = [f"medmnist splits pooled: {', '.join(opts.splits)}"]
    if opts.targets == "one_vs_rest":
        y, task = one_vs_rest(path, y, task)
        notes.append(f"one-vs-rest: {task.n_outputs} binary labels")
    if opts.channels is not None and opts.channels != x.shape[1]:
        notes.append(f"{x.shape[1]} channel(s) made {opts.channels}")
        x = match_channels(x, opts.channels)
    names = tuple(f"channel_{c}" for c in range(x.shape[1]))
    return Dataset(x, y, task, names, "image", notes=tuple(notes))


def _wfdb(path: Path, opts: Any) -> Dataset:
    from fedmqtt.data.ecg import LEADS, load_ecg_dir

    ecg = load_ecg_dir(path, labels=opts.labels, fs=opts.fs, length=opts.length)
    notes: tuple[str, ...] = ()
    if ecg.unknown_codes:
        notes = (f"ignored {sum(ecg.unknown_codes.values())} diagnosis code(s) outside the label list "
                 f"({len(ecg.unknown_codes)} distinct)",)
    return Dataset(ecg.x, ecg.y, ecg.task, LEADS, "ecg", groups={"source": ecg.sources},
                   features={"age": ecg.ages}, notes=notes)


def _physionet2012(path: Path, opts: Any) -> Dataset:
    from fedmqtt.data.physionet2012 import (
        DESCRIPTORS,
        HOURS,
        STATIC_NAMES,
        VARIABLES,
        cache_file,
        load_physionet2012,
        without_implausible,
    )

    cache = cache_file(path, outcomes=opts.outcomes, limit=opts.limit, cache_dir=opts.cache_dir)
    memo_key = None if cache is None else (str(cache), opts.model_dump_json())
    if memo_key is not None and memo_key in _ICU_MEMO:
        return _ICU_MEMO[memo_key]
    icu = load_physionet2012(path, outcomes=opts.outcomes, limit=opts.limit, cache_dir=opts.cache_dir)
    icu, removed = without_implausible(icu, opts.ranges)
    parts = [icu.values.astype(np.float32)]
    names = list(VARIABLES)
    if opts.masks:
        parts.append(icu.observed.astype(np.float32))
        names += [f"{v}_observed" for v in VARIABLES]
    parts.append(np.repeat(icu.static[:, None, :], HOURS, axis=1).astype(np.float32))
    names += list(STATIC_NAMES)
    fixed = tuple(range(len(VARIABLES), 2 * len(VARIABLES))) if opts.masks else ()
    if opts.target == "mortality":
        y: np.ndarray = np.where(np.isnan(icu.death), -1, icu.death).astype(np.int64)
        task = TaskInfo("binary", 1, ("0", "1"))
    else:
        y = icu.los.astype(np.float32)
        task = TaskInfo("regression", 1, ("length_of_stay_days",), target="log1p" if opts.log_scale else "identity")
    feats = {name: icu.static[:, k] for k, name in enumerate(STATIC_NAMES) if name in DESCRIPTORS}
    groups = {"ICUType": icu.icu_type.astype(str).astype(object)}
    data = Dataset(np.concatenate(parts, axis=2), y, task, tuple(names), "icu", groups=groups,
                   features=feats, fixed=fixed, removed=removed)
    if memo_key is not None:
        _ICU_MEMO.clear()  # one dataset kept: a simulation's sites all read the same one
        _ICU_MEMO[memo_key] = _read_only(data)
    return data


# The last PhysioNet 2012 dataset read with a cache dir, by its cache file's name (which changes with any
# stay file) and its options: a simulation's ~100 sites, its baselines and the held-out scoring each read
# the whole set and take their part; without this every one spent 1-2 s re-applying the ranges.
_ICU_MEMO: dict[tuple[str, str], Dataset] = {}


def _read_only(data: Dataset) -> Dataset:
    """`data` with every array locked, so a caller that wrote into the shared copy would fail loudly."""
    freeze_arrays(data.x, data.y, *data.groups.values(), *data.features.values(), *data.removed.values())
    return data
