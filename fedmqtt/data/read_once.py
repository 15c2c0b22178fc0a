"""Read each dataset file once per simulation: every simulated site of a partition reads the same pooled file.

A simulation of 20 sites over one compressed MedMNIST file used to decompress and convert the whole file 40
times (each agent at start, then the baselines once per site): about 1.5 s each, a minute and a half of a
run. Inside `shared_datasets()` the first read of a file is kept and every later read of the same file
with the same options gets it. Outside the block (a deployed site, `fedmqtt site check`) nothing is kept:
a site process reads its file once anyway and should not hold the raw copy beside its splits.

What is kept is made read-only, so a caller that would change it in place fails loudly instead of changing
what the next site reads; the readers of a dataset (partition selection, splits, normalisation) copy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel

T = TypeVar("T")
_CACHE: ContextVar[dict[str, Any] | None] = ContextVar("fedmqtt_shared_datasets", default=None)


@contextmanager
def shared_datasets() -> Iterator[None]:
    """Within this block, `read_once` reads each (file, options) once; nested blocks share the outer one."""
    if _CACHE.get() is not None:
        yield
        return
    token = _CACHE.set({})
    try:
        yield
    finally:
        _CACHE.reset(token)


def read_once(fmt: str, path: Path, options: BaseModel, read: Callable[[], T], freeze: Callable[[T], object]) -> T:
    """`read()`, or inside `shared_datasets()` what an earlier identical read returned.

    The key is the format, the resolved path, the options, and the file's size and modification time (a
    file rewritten during a run is read again). `freeze` makes a fresh result read-only before it is kept.
    """
    cache = _CACHE.get()
    if cache is None:
        return read()
    key = json.dumps([fmt, str(Path(path).resolve()), _stamp(Path(path)), options.model_dump_json()])
    if key not in cache:
        value = read()
        freeze(value)
        cache[key] = value
    result: T = cache[key]
    return result


def freeze_arrays(*arrays: np.ndarray) -> None:
    """Mark arrays read-only (views of a kept array stay read-only too)."""
    for a in arrays:
        a.flags.writeable = False


def _stamp(path: Path) -> list[int]:
    try:
        st = path.stat()
    except OSError:
        return []  # the read itself reports the missing file
    return [st.st_size, st.st_mtime_ns]
