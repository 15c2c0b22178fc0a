"""The PS's update spool and the sum over it: bit-identical to summing in-memory arrays, and the pages read
from the spool leave the PS's resident memory as the sum goes (a 512 MB layer from N sites must not stay
mapped N times over)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedmqtt.strategies.aggregate import convex_combine
from ps_daemon.spool import UpdateSpool
from schemas.tensors import arrays_to_blobs


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current RSS


def test_summing_spooled_updates_is_exact_and_releases_their_pages(tmp_path: Path) -> None:
    # Prepare: three sites' 96 MB tensors on the spool, behind a small tensor (offsets not page-aligned)
    rng = np.random.default_rng(0)
    n = 24_000_000
    spool = UpdateSpool(tmp_path / "spool")
    arrays = [rng.standard_normal(n, dtype=np.float32) for _ in range(3)]
    spooled = [spool.put(1, f"site-{i}", arrays_to_blobs({"a": np.ones(3, np.float32), "w": a}))
               for i, a in enumerate(arrays)]
    weights = [0.2, 0.3, 0.5]
    expected = np.zeros(n, np.float64)
    for w, a in zip(weights, arrays, strict=True):
        expected += np.float64(w) * a.astype(np.float64)
    del arrays
    out = np.empty(n, np.float32)
    out.fill(0.0)  # the result's own 96 MB, resident before the peak is measured
    _reset_peak_rss()
    before = _status_mb("VmRSS")
    # Execute
    got = convex_combine((s["w"] for s in spooled), weights, out)
    peak = _status_mb("VmHWM")
    # Assert: the same bits as the in-memory sum in the same order; while summing, the result (96 MB, paged in
    # as it is written) and 16 MB of scratch, not the 288 MB read from the spool
    assert np.array_equal(got, expected.astype(np.float32))
    assert peak - before < 96 + 16 + 40, f"peak {peak - before:.0f} MB above the start"


def test_dropping_read_pages_of_maps_frees_them_while_the_maps_live(tmp_path: Path) -> None:
    """The PS holds its current model as maps of the newest checkpoint: after a publish has read them, their
    pages leave its resident memory although the maps stay in use."""
    from ps_daemon.checkpoint import drop_read_pages

    path = tmp_path / "model.bin"
    np.arange(30_000_000, dtype=np.float32).tofile(path)  # 120 MB
    weights = {"w": np.memmap(path, dtype="<f4", mode="r", offset=4, shape=(29_000_000,)),
               "small": np.ones(3, np.float32)}
    before = _status_mb("RssFile")
    assert float(weights["w"].sum(dtype=np.float64)) > 0  # reads every page
    read = _status_mb("RssFile")
    drop_read_pages(weights)
    after = _status_mb("RssFile")
    assert read - before > 100 and after - before < 10
    assert weights["w"][-1] == 29_000_000  # still valid: faults back in from the page cache


def test_lookups_are_views_of_one_map_that_free_their_pages_and_go_with_the_round(tmp_path: Path) -> None:
    """One map per spooled file (not one per lookup): every tensor, at unaligned offsets and in every dtype,
    reads back bit for bit; a freed view's pages leave resident memory; dropping the round releases the map."""
    rng = np.random.default_rng(1)
    tensors = {"bias": rng.standard_normal(3).astype(np.float16), "big": rng.standard_normal(12_000_000),
               "count": np.array(7, np.int64), "empty": np.zeros((0, 4), np.float32),
               "w": rng.standard_normal((5, 7)).astype(np.float32), "flags": np.array([True, False])}
    spool = UpdateSpool(tmp_path / "spool")
    spooled = spool.put(1, "site-0", arrays_to_blobs(tensors))
    for name, want in tensors.items():
        got = spooled[name]
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), name
        assert not got.flags.writeable or got.size == 0
    first, second = spooled["w"], spooled["big"]
    assert first.base is second.base is spooled._map  # one map, however many lookups
    # A 96 MB tensor read through a view: its pages are resident while the view lives, gone once it is freed
    before = _status_mb("RssFile")
    assert np.array_equal(second, tensors["big"])  # reads every page
    assert _status_mb("RssFile") - before > 80
    del second
    assert _status_mb("RssFile") - before < 10
    assert spooled["big"][-1] == tensors["big"][-1]  # the map is intact: the pages fault back in
    # Dropping the round forgets the map and removes the file; a view still held stays valid
    spool.drop_before(2)
    assert spooled._map is None and not spooled.path.exists()
    assert first.tobytes() == tensors["w"].tobytes()
