"""Pure, seeded heterogeneity partitioners: one pooled dataset into simulated sites (docs/algorithms.md 16)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedmqtt.data.base import TaskInfo
from fedmqtt.errors import DataError
from fedmqtt.recruitment import label_histogram

PartitionKind = Literal[
    "natural", "iid", "label_skew", "quantity_skew", "feature_intervals", "feature_samples", "adafed_pairs"
]
# `column` values that pick the feature by |Pearson r| with the label on the pooled data (16.3).
AUTO_MAX, AUTO_MIN = "auto_max", "auto_min"
T = TypeVar("T")
_CUT_EPS = 1e-9  # the cut rule's guard against cumulative sums such as 2.9999999999 (16 common rules)


class PartitionSpec(BaseModel):
    """How to split a pooled dataset into sites; the same spec and seed always give the same split."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: PartitionKind
    n_sites: int | None = Field(default=None, ge=1, description="sites to make (natural: one per group)")
    alpha: float | None = Field(default=None, gt=0, description="Dirichlet concentration (label/quantity skew, "
                                "adafed_pairs)")
    column: str | None = Field(default=None, description=f"natural: the site column; feature_*: the feature, "
                               f"or {AUTO_MAX!r}/{AUTO_MIN!r}: largest/smallest |Pearson r| with the label")
    cap: int | None = Field(default=None, ge=1, description="at most this many items per site (applied last)")
    labels_per_site: int | None = Field(
        default=None, ge=1, description="partial labels (multi-label data): each site annotates only this "
        "many of the labels, the others are unknown (NaN, masked in loss and metrics); see annotated_labels")
    seed: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> PartitionSpec:
        if self.kind != "natural" and self.n_sites is None:
            raise ValueError(f"partition kind {self.kind!r} needs n_sites")
        if self.kind in ("label_skew", "quantity_skew", "adafed_pairs") and self.alpha is None:
            raise ValueError(f"partition kind {self.kind!r} needs alpha (Dirichlet concentration)")
        if self.kind == "adafed_pairs" and (self.n_sites or 0) < ADAFED_GROUP:
            raise ValueError(f"partition kind 'adafed_pairs' needs n_sites >= {ADAFED_GROUP}")
        if self.kind.startswith("feature_") and not self.column:
            raise ValueError(f"partition kind {self.kind!r} needs column (a feature, {AUTO_MAX}, {AUTO_MIN})")
        if self.kind == "natural" and not self.column:
            raise ValueError("partition kind 'natural' needs column (the site column)")
        return self


def cut_sizes(n: int, proportions: Sequence[float] | np.ndarray) -> np.ndarray:
    """Piece sizes of the cut rule: cuts at floor(C_k * n + 1e-9) for cumulative sums C_k; all n assigned."""
    cum = np.cumsum(np.asarray(proportions, dtype=np.float64))[:-1]
    cuts = np.clip(np.floor(cum * n + _CUT_EPS).astype(np.int64), 0, n)
    return np.diff(np.concatenate([[0], cuts, [n]]))


def _cut(items: np.ndarray, proportions: np.ndarray) -> list[np.ndarray]:
    return np.split(items, np.cumsum(cut_sizes(len(items), proportions))[:-1])


def _classes(y: np.ndarray | None, kind: str) -> np.ndarray:
    if y is None:
        raise DataError(f"partition kind {kind!r} needs labels")
    y = np.asarray(y)
    if y.ndim != 1 or (y.dtype.kind == "f" and not np.all(np.isfinite(y) & (y == np.round(y)))):
        raise DataError(f"partition kind {kind!r} needs one integer class per item (not multilabel or "
                        f"regression targets); got labels of shape {y.shape} and dtype {y.dtype}")
    return y.astype(np.int64)


def iid(n: int, n_sites: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A uniform shuffle cut into n_sites pieces of equal size (within one)."""
    return _cut(rng.permutation(n), np.full(n_sites, 1.0 / n_sites))


def split_by_class(
    y: np.ndarray, proportions: Sequence[np.ndarray], rng: np.random.Generator
) -> list[np.ndarray]:
    """Shuffle each class (ascending order) and cut it with the cut rule and that class's proportions."""
    classes = np.unique(y)
    n_sites = len(proportions[0]) if len(proportions) else 0
    pieces: list[list[np.ndarray]] = [[] for _ in range(n_sites)]
    for c, prop in zip(classes, proportions, strict=True):
        for k, part in enumerate(_cut(rng.permutation(np.flatnonzero(y == c)), np.asarray(prop))):
            pieces[k].append(part)
    return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in pieces]


def label_skew(y: np.ndarray, n_sites: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """16.2: an independent q^j ~ Dir(alpha) per class j (drawn first, ascending j), then split_by_class."""
    q = [rng.dirichlet(np.full(n_sites, alpha)) for _ in np.unique(y)]
    return split_by_class(y, q, rng)


def quantity_skew(y: np.ndarray, n_sites: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """16.1 DECISION: one p ~ Dir(alpha) for every class, so label proportions match up to rounding."""
    p = rng.dirichlet(np.full(n_sites, alpha))
    return split_by_class(y, [p] * len(np.unique(y)), rng)


# Chen et al., AdaFed: their code draws its Dirichlet label split for groups of this many clients at a time.
ADAFED_GROUP = 2
# A pair's draw is repeated until each of its clients holds at least this share of an equal part.
ADAFED_MIN_SHARE = 0.5
ADAFED_MAX_DRAWS = 1000


def adafed_pairs(y: np.ndarray, n_sites: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """16.6: the client split of Chen et al.'s AdaFed code, as we read it, with our own seeded draws.

    1. Shuffle all items; cut the order into consecutive blocks of `2n // K` items, one block per pair of
       clients (the last block, of one or two clients, takes the rest).
    2. Within a block, a Dirichlet label split between its clients (`_pair_split`).
    3. Concatenate the blocks' clients in order, and cut that sequence into K equal slices of `n // K`
       items: a site is a slice, so it mixes the tail of one Dirichlet client with the head of the next.
       The last `n mod K` items of the sequence belong to no site, as in the authors' code.

    Sites are therefore equal in size with a moderate label skew (on OrganAMNIST at alpha 0.1: 2,941 images
    each, a median of 6 of the 11 classes above 5 %), not the very unequal sites of a plain K-way Dirichlet.
    """
    n = len(y)
    if n < n_sites:
        raise DataError(f"adafed_pairs: {n} items cannot make {n_sites} sites")
    classes = np.unique(y)
    order = rng.permutation(n)
    n_groups = -(-n_sites // ADAFED_GROUP)
    width = ADAFED_GROUP * n // n_sites
    pieces: list[np.ndarray] = []
    for g in range(n_groups):
        last = g == n_groups - 1
        block = order[g * width: n if last else (g + 1) * width]
        clients = n_sites - ADAFED_GROUP * g if last else ADAFED_GROUP
        pieces.extend(_pair_split(block, y, classes, clients, alpha, rng))
    sequence = np.concatenate(pieces)
    size = n // n_sites
    return [sequence[k * size: (k + 1) * size] for k in range(n_sites)]


def _pair_split(block: np.ndarray, y: np.ndarray, classes: np.ndarray, clients: int, alpha: float,
                rng: np.random.Generator) -> list[np.ndarray]:
    """A Dirichlet label split of `block` between `clients`, kept near equal sizes.

    For each class (ascending) draw `q ~ Dir(alpha)`; a client that already holds its equal share
    (`len(block) / clients`) gets none of the class (its proportion is zeroed and the rest renormalised;
    when every client is full the draw is used as it is); cut the class's items (in block order) with the
    cut rule. Redraw the whole block until every client holds at least ADAFED_MIN_SHARE of an equal share.
    """
    share = len(block) / clients
    floor = int(ADAFED_MIN_SHARE * share)
    members = [block[y[block] == c] for c in classes]
    for _ in range(ADAFED_MAX_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
        sizes = np.zeros(clients, dtype=np.int64)
        for items in members:
            q = rng.dirichlet(np.full(clients, alpha))
            open_q = q * (sizes < share)
            if open_q.sum() > 0:
                q = open_q / open_q.sum()
            for k, part in enumerate(_cut(items, q)):
                parts[k].append(part)
                sizes[k] += len(part)
        if sizes.min() >= floor:
            return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts]
    raise DataError(f"adafed_pairs: no draw in {ADAFED_MAX_DRAWS} gave each of {clients} clients at least "
                    f"{floor} of {len(block)} items (alpha {alpha:g}); use a larger alpha")


def feature_intervals(values: np.ndarray, n_sites: int) -> list[np.ndarray]:
    """16.3 even intervals: site = min(floor((x - min) / width), K - 1), width = (max - min) / K.

    Interior boundaries belong to the upper interval; the 1e-9 guard keeps a value that sits on a boundary
    there despite float division (e.g. 0.6 / 0.3 = 1.9999999999999998).
    """
    x = np.asarray(values, dtype=np.float64)
    lo, hi = float(x.min()), float(x.max())
    width = (hi - lo) / n_sites
    if width == 0:
        site = np.zeros(len(x), dtype=np.int64)  # one value only: everything in the first interval
    else:
        site = np.minimum(np.floor((x - lo) / width + _CUT_EPS).astype(np.int64), n_sites - 1)
    return [np.flatnonzero(site == k) for k in range(n_sites)]


def feature_samples(values: np.ndarray, n_sites: int) -> list[np.ndarray]:
    """16.3 even samples: stable sort by the feature, cut at floor(k * n / K); ties may straddle a cut."""
    order = np.argsort(np.asarray(values, dtype=np.float64), kind="stable")
    n = len(order)
    return np.split(order, [k * n // n_sites for k in range(1, n_sites)])


def pick_feature(features: Mapping[str, np.ndarray], y: np.ndarray, *, largest: bool = True) -> str:
    """16.3: the feature with the largest (or smallest) absolute Pearson correlation with the label.

    Uses the rows where both are present; constant features are skipped; ties go to the first name.
    """
    y = np.asarray(y, dtype=np.float64)
    scores: dict[str, float] = {}
    for name, col in features.items():
        col = np.asarray(col, dtype=np.float64)
        ok = np.isfinite(col) & np.isfinite(y)
        if ok.sum() > 2 and np.std(col[ok]) > 0 and np.std(y[ok]) > 0:
            scores[name] = abs(float(np.corrcoef(col[ok], y[ok])[0, 1]))
    if not scores:
        raise DataError("no feature has a defined correlation with the label (all constant or missing)")
    pick = max if largest else min
    return pick(scores, key=lambda name: scores[name])


def natural(groups: Sequence[object] | np.ndarray) -> tuple[list[str], list[np.ndarray]]:
    """One site per distinct group value (sorted); returns (site names, index arrays)."""
    values = np.asarray([str(g) for g in groups], dtype=object)
    names = sorted(set(values.tolist()))
    return [site_name(v) for v in names], [np.flatnonzero(values == v) for v in names]


def site_name(value: object) -> str:
    """A group value as a site id ([a-z0-9-]): 'PTB-XL' -> 'ptb-xl', 'Govt_job' -> 'govt-job'."""
    slug = re.sub(r"[^a-z0-9-]+", "-", str(value).strip().lower()).strip("-")
    return slug or "empty"


def default_site_names(n_sites: int) -> list[str]:
    return [f"site-{k}" for k in range(n_sites)]


def apply_cap(parts: list[np.ndarray], cap: int | None, rng: np.random.Generator) -> list[np.ndarray]:
    """19.1 item 18: sites above `cap` keep a uniform random subset of `cap` items (without replacement)."""
    if cap is None:
        return parts
    return [rng.choice(p, size=cap, replace=False) if len(p) > cap else p for p in parts]


def heterogeneity_level(alpha: float) -> str:
    """16.4 (Milasheuski et al., Table II): the heterogeneity level a Dirichlet alpha stands for."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    levels = ((0.1, "extreme"), (0.3, "high"), (0.5, "high/medium"), (0.7, "medium"), (10.0, "low"))
    for bound, level in levels:
        if alpha < bound:
            return level
    return "homogeneous"


def site_names_for(spec: PartitionSpec, groups: Sequence[object] | np.ndarray | None = None) -> list[str]:
    """The site names of `partition`'s parts: the group values for natural, else site-0, site-1, ..."""
    if spec.kind == "natural":
        if groups is None:
            raise DataError(f"natural partition needs the group column {spec.column!r}")
        return natural(groups)[0]
    return default_site_names(int(spec.n_sites or 0))


def partition(
    spec: PartitionSpec, y: np.ndarray | None, *, features: Mapping[str, np.ndarray] | None = None,
    groups: Sequence[object] | np.ndarray | None = None, n_items: int | None = None,
) -> list[np.ndarray]:
    """Split items 0..n-1 into sites by `spec`; sorted int64 index arrays, one per site.

    Args:
        spec: the partitioner, its parameters and its seed (one numpy Generator drives every draw).
        y: one integer class per item (label skew needs it; quantity skew stratifies by it when given).
        features: name -> one value per item, for feature skew (NaN = missing; such items are spread IID).
        groups: one group value per item, for natural.
        n_items: the item count when neither y, groups nor features give it.
    """
    n = _count(y, features, groups, n_items)
    rng = np.random.default_rng(spec.seed)
    k = int(spec.n_sites or 0)
    if spec.kind == "natural":
        if groups is None:
            raise DataError(f"partition kind 'natural' needs the group column {spec.column!r}")
        names, parts = natural(groups)
        if spec.n_sites is not None and spec.n_sites != len(names):
            raise DataError(f"column {spec.column!r} has {len(names)} groups ({', '.join(names)}), "
                            f"not n_sites = {spec.n_sites}")
    elif spec.kind == "iid":
        parts = iid(n, k, rng)
    elif spec.kind == "label_skew":
        parts = label_skew(_classes(y, spec.kind), k, float(spec.alpha or 0), rng)
    elif spec.kind == "quantity_skew":
        classes = np.zeros(n, np.int64) if y is None else _classes(y, spec.kind)
        parts = quantity_skew(classes, k, float(spec.alpha or 0), rng)
    elif spec.kind == "adafed_pairs":
        parts = adafed_pairs(_classes(y, spec.kind), k, float(spec.alpha or 0), rng)
    else:
        parts = _feature_skew(spec, y, _need(features, spec.kind, "features"), rng)
    parts = apply_cap(parts, spec.cap, rng)
    return [np.sort(p).astype(np.int64) for p in parts]


def _count(y: object, features: Mapping[str, np.ndarray] | None, groups: object, n_items: int | None) -> int:
    for arr in (y, groups, *(features or {}).values()):
        if arr is not None:
            return len(arr)  # type: ignore[arg-type]
    if n_items is None:
        raise DataError("partition needs labels, groups, features or n_items to know the item count")
    return n_items


def _need(value: T | None, kind: str, what: str) -> T:
    if value is None:
        raise DataError(f"partition kind {kind!r} needs {what}")
    return value


def _feature_skew(spec: PartitionSpec, y: np.ndarray | None, features: Mapping[str, np.ndarray],
                  rng: np.random.Generator) -> list[np.ndarray]:
    column = str(spec.column)
    if column in (AUTO_MAX, AUTO_MIN):
        column = pick_feature(features, _need(y, spec.kind, f"labels to pick the {column} feature"),
                              largest=column == AUTO_MAX)
    if column not in features:
        raise DataError(f"no feature column {column!r}; known: {', '.join(features)}")
    values = np.asarray(features[column], dtype=np.float64)
    present = np.flatnonzero(np.isfinite(values))
    if present.size == 0:
        raise DataError(f"feature column {column!r} has no values")
    split = feature_intervals if spec.kind == "feature_intervals" else feature_samples
    k = int(spec.n_sites or 0)
    parts = [present[p] for p in split(values[present], k)]
    missing = np.flatnonzero(~np.isfinite(values))
    if missing.size:  # a missing value has no place on the axis: spread those items uniformly (seeded)
        parts = [np.concatenate([p, missing[m]]) for p, m in zip(parts, iid(missing.size, k, rng), strict=True)]
    return parts


def label_histograms(
    y: np.ndarray, parts: Sequence[np.ndarray], task: TaskInfo | None = None
) -> list[dict[str, int]]:
    """Per-site label counts, keyed like a site's reported histogram (fedmqtt.recruitment.label_histogram).

    Class counts for binary/multiclass, per-label positives for multilabel, the length-of-stay bins of
    docs/algorithms.md 15 for regression; unlabelled items (-1, NaN) are not counted. Without `task`, 2-D y is
    multilabel, non-integer y regression.
    """
    y = np.asarray(y)
    task = task or _guess_task(y)
    out = []
    for p in parts:
        part = y[np.asarray(p, dtype=np.int64)]
        if task.kind == "regression":
            part = part[np.isfinite(part)]  # unlabelled items have no bin
        elif task.kind in ("binary", "multiclass"):
            part = part[part >= 0]  # -1 = unlabelled
        out.append(label_histogram(task.kind, part, task.n_outputs))
    return out


def _guess_task(y: np.ndarray) -> TaskInfo:
    if y.ndim == 2:
        return TaskInfo("multilabel", int(y.shape[1]))
    if y.dtype.kind == "f" and not np.all(np.isfinite(y) & (y == np.round(y))):
        return TaskInfo("regression", 1)
    n_classes = int(y.max()) + 1 if y.size else 2
    return TaskInfo("binary", 1) if n_classes <= 2 else TaskInfo("multiclass", n_classes)


def annotated_labels(n_labels: int, n_sites: int, per_site: int, seed: int) -> list[list[int]]:
    """Partial labels (Kulkarni et al.'s setting): which `per_site` of the `n_labels` label columns each site
    annotates.

    The labels are shuffled (seeded, a stream of its own so the item split is unchanged) and dealt round
    robin, `per_site` consecutive labels per site: every label is annotated somewhere whenever
    `n_sites * per_site >= n_labels`, and the sites' sets overlap as little as that allows.

    Raises:
        DataError: `per_site` is more than the labels there are.
    """
    if per_site > n_labels:
        raise DataError(f"labels_per_site = {per_site}, but the data has only {n_labels} labels")
    order = np.random.default_rng([seed, 4]).permutation(n_labels)
    return [sorted(int(order[(k * per_site + j) % n_labels]) for j in range(per_site))
            for k in range(n_sites)]


MANIFEST_VERSION: Literal["fedmqtt.partition/1"] = "fedmqtt.partition/1"


class SitePart(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    site: str
    n: int = Field(ge=0)
    histogram: dict[str, int]
    indices: list[int]
    annotated: list[int] | None = None  # partial labels: the label columns this site annotates (else all)


class PartitionManifest(BaseModel):
    """What `fedmqtt partition` writes: the spec, where the pooled data came from, and every site's items.

    `sites` is a list of {site, n, histogram, indices}, the shape `fedmqtt recruit --manifest` reads.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal["fedmqtt.partition/1"] = MANIFEST_VERSION
    spec: PartitionSpec
    source: dict[str, Any] = Field(description="format, path, options and n_items of the pooled dataset")
    sites: list[SitePart]

    def site_part(self, site: str) -> SitePart:
        for part in self.sites:
            if part.site == site:
                return part
        raise DataError(f"partition has no site {site!r}; its sites: {', '.join(p.site for p in self.sites)}")

    def site_indices(self, site: str) -> np.ndarray:
        return np.asarray(self.site_part(site).indices, dtype=np.int64)


def write_partition_manifest(path: Path, spec: PartitionSpec, parts: Sequence[np.ndarray],
                             histograms: Sequence[Mapping[str, int]], source: Mapping[str, Any], *,
                             site_names: Sequence[str] | None = None) -> PartitionManifest:
    """Write the manifest as JSON (indented, one line of indices per site) and return it."""
    names = list(site_names) if site_names is not None else default_site_names(len(parts))
    if not len(names) == len(parts) == len(histograms) or len(set(names)) != len(names):
        raise DataError(f"{len(parts)} parts, {len(histograms)} histograms and site names {names} "
                        "do not match")
    annotated: list[list[int] | None] = [None] * len(parts)
    if spec.labels_per_site is not None and source.get("task", "multilabel") != "multilabel":
        raise DataError(f"labels_per_site (partial labels) needs multi-label data; this is {source['task']}")
    if spec.labels_per_site is not None and parts:
        per_site = annotated_labels(len(histograms[0]), len(parts), spec.labels_per_site, spec.seed)
        annotated = list(per_site)
        # a site reports positives of the labels it annotates only (as its masked labels give at run time)
        histograms = [{k: (c if int(k) in a else 0) for k, c in h.items()}
                      for h, a in zip(histograms, per_site, strict=True)]
    manifest = PartitionManifest(spec=spec, source=dict(source), sites=[
        SitePart(site=name, n=len(p), histogram=dict(h), indices=[int(i) for i in p], annotated=a)
        for name, p, h, a in zip(names, parts, histograms, annotated, strict=True)])
    doc = manifest.model_dump(mode="json")
    flat = []
    for k, site in enumerate(doc["sites"]):  # placeholders keep a 50k-index list on one line
        flat.append(json.dumps(site["indices"]))
        site["indices"] = f"@@indices-{k}@@"
    text = json.dumps(doc, indent=2)
    for k, line in enumerate(flat):
        text = text.replace(f'"@@indices-{k}@@"', line)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    tmp.replace(path)
    return manifest


def read_partition_manifest(path: Path) -> PartitionManifest:
    """Read and validate a manifest; any problem is a DataError naming the file."""
    try:
        return PartitionManifest.model_validate_json(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise DataError(f"{path}: cannot read partition manifest: {exc}") from exc
    except ValidationError as exc:
        raise DataError(f"{path}: not a valid partition manifest: {exc}") from exc
