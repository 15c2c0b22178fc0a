"""The site's stored uplinks (site_agent/store.py): the newest three per kind, byte for byte, 0600, and the file
pruned for a new one is written over in place (its pages reused) without changing what survives a crash."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fedmqtt.atomic import write_atomic
from site_agent.store import KEEP, UplinkStore

HASH = "ab" * 32


def _payload(round_no: int, size: int) -> list[bytes | memoryview]:
    body = bytes([round_no % 256]) * size
    return [b"head", memoryview(body), b"tail"]


def test_saved_payloads_read_back_exactly_and_only_the_newest_are_kept(tmp_path: Path) -> None:
    # Prepare: sizes that grow and shrink, so a recycled file must be cut to the new length
    store = UplinkStore(tmp_path / "uplink")
    sizes = [300_000, 900_000, 100_000, 500_000, 50, 700_000, 1]
    inodes = {}
    for r, size in enumerate(sizes, start=1):
        doomed = sorted((tmp_path / "uplink").glob("update-r*.msgpack"))
        # Execute
        path = store.save("update", r, HASH, _payload(r, size))
        # Assert: the bytes given, 0600; from the fourth round on the new file is the pruned one's inode
        assert path.read_bytes() == b"".join(bytes(p) for p in _payload(r, size))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        if len(doomed) >= KEEP:
            assert path.stat().st_ino == inodes[doomed[0].name]
        inodes[path.name] = path.stat().st_ino
        kept = sorted(p.name for p in (tmp_path / "uplink").iterdir())
        assert kept == [f"update-r{k:06d}-{HASH[:16]}.msgpack" for k in range(max(1, r - KEEP + 1), r + 1)]
    for r in range(len(sizes) - KEEP + 1, len(sizes) + 1):
        assert store.load("update", r, HASH) == b"".join(bytes(p) for p in _payload(r, sizes[r - 1]))


def test_saving_an_older_round_recycles_nothing_that_would_have_been_kept(tmp_path: Path) -> None:
    # Prepare: rounds 5, 6, 7 stored
    store = UplinkStore(tmp_path / "uplink")
    for r in (5, 6, 7):
        store.save("update", r, HASH, b"x" * (1000 + r))
    # Execute: round 2 arrives (it sorts first, so the pruning removes it, exactly as before)
    store.save("update", 2, HASH, b"old")
    # Assert
    assert [store.load("update", r, HASH) for r in (2, 5, 6, 7)] == [None, *(b"x" * (1000 + r) for r in (5, 6, 7))]


def test_a_write_that_fails_half_way_leaves_the_target_and_every_kept_file_as_they_were(tmp_path: Path) -> None:
    # Prepare
    store = UplinkStore(tmp_path / "uplink")
    for r in (1, 2, 3):
        store.save("update", r, HASH, b"r%d" % r)

    def pieces():  # noqa: ANN202
        yield b"partial " * 1000
        raise OSError("disk gone")

    # Execute
    with pytest.raises(OSError, match="disk gone"):
        store.save("update", 4, HASH, pieces())  # type: ignore[arg-type]  # an iterable of pieces
    # Assert: round 4 absent (never torn); rounds 2 and 3 intact; only round 1, which this save prunes, is gone
    assert store.load("update", 4, HASH) is None
    assert [store.load("update", r, HASH) for r in (2, 3)] == [b"r2", b"r3"]


def test_a_recycled_path_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    # Prepare: the file to recycle is a symlink to something outside
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me")
    link = tmp_path / "old.bin"
    os.symlink(outside, link)
    # Execute
    write_atomic(tmp_path / "new.bin", b"new", recycle=link)
    # Assert: the new file written fresh; the link's target untouched
    assert (tmp_path / "new.bin").read_bytes() == b"new" and outside.read_bytes() == b"keep me"
    assert stat.S_IMODE((tmp_path / "new.bin").stat().st_mode) == 0o600
