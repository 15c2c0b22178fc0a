"""MedMNIST `.npz` files (train/val/test images and labels) as float32 (n, c, h, w) images in [0, 1]."""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from fedmqtt.data.base import TaskInfo
from fedmqtt.errors import DataError

Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = ("train", "val", "test")


def load_medmnist(path: Path, *, splits: Sequence[str] = SPLITS) -> tuple[np.ndarray, np.ndarray, TaskInfo]:
    """Read the asked official splits of a MedMNIST file and pool them in the order given.

    Returns:
        `(images, labels, task)`: images float32 `(n, 1|3, h, w)` scaled from uint8 to [0, 1]; labels int64
        `(n,)` for single-label files (the class count is read from every split in the file, so picking one
        split never shrinks it; 2 classes make a binary task), float32 `(n, k)` for multi-label files
        such as ChestMNIST.

    Raises:
        DataError: unreadable file, a missing key, or images/labels of the wrong shape or range.
    """
    path = Path(path)
    unknown = [s for s in splits if s not in SPLITS]
    if unknown or not splits:
        raise DataError(f"MedMNIST splits must be a non-empty subset of {list(SPLITS)}, got {list(splits)}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            keys = set(npz.files)
            for key in (f"{s}_{kind}" for s in splits for kind in ("images", "labels")):
                if key not in keys:
                    raise DataError(f"{path}: no array {key!r}; the file holds {sorted(keys)}")
            # Every split's labels fix the class count; only the asked splits' images are read.
            all_labels: dict[str, np.ndarray] = {s: npz[f"{s}_labels"] for s in SPLITS if f"{s}_labels" in keys}
            raw_images: dict[str, np.ndarray] = {s: npz[f"{s}_images"] for s in splits}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: cannot read MedMNIST .npz: {exc}") from exc
    task = _task(path, list(all_labels.values()))
    images = [_images(path, s, raw_images[s]) for s in splits]
    labels = [_labels(path, s, all_labels[s], len(im), task) for s, im in zip(splits, images, strict=True)]
    if len({im.shape[1:] for im in images}) != 1:
        raise DataError(f"{path}: the splits' images differ in shape: {[im.shape[1:] for im in images]}")
    return np.concatenate(images), np.concatenate(labels), task


def _images(path: Path, split: str, raw: np.ndarray) -> np.ndarray:
    # MedMNIST stores grey images as (n, h, w) and colour ones as (n, h, w, 3), both uint8.
    if raw.ndim == 3:
        raw = raw[:, None, :, :]
    elif raw.ndim == 4 and raw.shape[-1] in (1, 3):
        raw = raw.transpose(0, 3, 1, 2)
    else:
        raise DataError(f"{path}: {split}_images has shape {raw.shape}; expected (n, h, w) or (n, h, w, 1|3)")
    if raw.dtype != np.uint8:
        raise DataError(f"{path}: {split}_images has dtype {raw.dtype}; expected uint8 (0-255)")
    return raw.astype(np.float32) / np.float32(255.0)


def _task(path: Path, labels: list[np.ndarray]) -> TaskInfo:
    widths = {1 if a.ndim == 1 else a.shape[1] for a in labels}
    if len(widths) != 1 or any(a.ndim > 2 for a in labels):
        raise DataError(f"{path}: label arrays have inconsistent shapes {[a.shape for a in labels]}")
    width = widths.pop()
    if width > 1:
        return TaskInfo("multilabel", width, tuple(str(k) for k in range(width)))
    n_classes = int(max(int(a.max()) for a in labels if a.size)) + 1
    names = tuple(str(k) for k in range(max(n_classes, 2)))
    return TaskInfo("binary", 1, names) if n_classes <= 2 else TaskInfo("multiclass", n_classes, names)


def _labels(path: Path, split: str, raw: np.ndarray, n: int, task: TaskInfo) -> np.ndarray:
    if raw.shape[0] != n:
        raise DataError(f"{path}: {split}_labels has {raw.shape[0]} rows but {split}_images has {n}")
    if raw.size and (raw.min() < 0 or (task.kind == "multilabel" and raw.max() > 1)):
        raise DataError(f"{path}: {split}_labels has values outside the label range "
                        f"({raw.min()}..{raw.max()})")
    if task.kind == "multilabel":
        return raw.astype(np.float32)
    return raw.reshape(-1).astype(np.int64)


# ITU-R BT.601 luma weights: the usual colour-to-grey conversion (what PIL's "L" mode uses)
LUMA_BT601 = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def one_vs_rest(path: Path, labels: np.ndarray, task: TaskInfo) -> tuple[np.ndarray, TaskInfo]:
    """Class k of a single-label file as k binary labels: float32 `(n, classes)` rows of one 1 and zeros, a
    multi-label task with the class names (so each label can be annotated or not, site by site)."""
    if task.kind not in ("binary", "multiclass"):
        raise DataError(f"{path}: targets = \"one_vs_rest\" needs a single-label file; this one is {task.kind}")
    classes = len(task.label_names)
    out = np.zeros((labels.shape[0], classes), dtype=np.float32)
    out[np.arange(labels.shape[0]), labels] = 1.0
    return out, TaskInfo("multilabel", classes, task.label_names)


def match_channels(images: np.ndarray, channels: int) -> np.ndarray:
    """`(n, c, h, w)` images with `channels` channels: grey repeated into 3, or colour made grey (BT.601)."""
    have = images.shape[1]
    if have == channels:
        return images
    if have == 1 and channels == 3:
        return np.repeat(images, 3, axis=1)
    if have == 3 and channels == 1:
        return np.einsum("nchw,c->nhw", images, LUMA_BT601)[:, None, :, :].astype(np.float32)
    raise DataError(f"cannot turn {have}-channel images into {channels} channels")
