"""A simulation's sites share one read of PhysioNet 2012 (with a cache dir), and never a stale or writable one."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import fedmqtt.data.physionet2012 as icu_module
from fedmqtt.data.physionet2012 import VARIABLES, cache_file
from fedmqtt.data.registry import load_dataset
from fedmqtt.data.spec import DataSpec
from tests.unit.test_data_adapters import write_icu


def spec(set_dir: Path, cache: Path | None) -> DataSpec:
    options: dict[str, object] = {"target": "los"}
    if cache is not None:
        options["cache_dir"] = str(cache)
    return DataSpec(format="physionet2012", path=set_dir, options=options)


def test_second_read_reuses_the_dataset_read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_dir = write_icu(tmp_path / "data")
    first = load_dataset(spec(set_dir, tmp_path / "cache"))
    monkeypatch.setattr(icu_module, "without_implausible", lambda *a: pytest.fail("ranges applied again"))
    again = load_dataset(spec(set_dir, tmp_path / "cache"))
    assert again is first
    with pytest.raises(ValueError, match="read-only"):
        again.x[0, 0, 0] = 1.0


def test_a_changed_stay_is_read_anew(tmp_path: Path) -> None:
    set_dir = write_icu(tmp_path / "data")
    before = cache_file(set_dir, cache_dir=tmp_path / "cache")
    hr = VARIABLES.index("HR")
    assert load_dataset(spec(set_dir, tmp_path / "cache")).x[1, 2, hr] == 90
    stay = set_dir / "000000.txt"
    stay.write_text(stay.read_text().replace("02:10,HR,90", "02:10,HR,95"))
    os.utime(stay, ns=(stay.stat().st_atime_ns, stay.stat().st_mtime_ns + 10**9))
    assert cache_file(set_dir, cache_dir=tmp_path / "cache") != before
    assert load_dataset(spec(set_dir, tmp_path / "cache")).x[1, 2, hr] == 95


def test_without_a_cache_dir_every_read_is_fresh(tmp_path: Path) -> None:
    set_dir = write_icu(tmp_path / "data")
    first, again = load_dataset(spec(set_dir, None)), load_dataset(spec(set_dir, None))
    assert first is not again and first.x.flags.writeable
    assert np.array_equal(first.x, again.x, equal_nan=True)
