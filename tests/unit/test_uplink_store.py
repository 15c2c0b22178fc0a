"""The site's stored uplinks (site_agent/store.py): the newest three per kind, byte for byte, 0600, and the file
pruned for a new one is written over in place (its pages reused) without changing what survives a crash."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fedmqtt.atomic import SPARE_FROM, make_spare, write_atomic
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


BIG = SPARE_FROM + 4096  # a payload that gets spare files


def test_from_the_second_save_on_every_payload_is_written_over_a_file_that_existed(tmp_path: Path) -> None:
    # Prepare: model-sized payloads, a little different in size each round
    folder = tmp_path / "uplink"
    store = UplinkStore(folder)
    inodes_before_round: list[set[int]] = []
    for r in range(1, 8):
        inodes_before_round.append({p.stat().st_ino for p in folder.iterdir()})
        # Execute
        path = store.save("update", r, HASH, _payload(r, BIG + 1000 * (r % 3)))
        # Assert: read back exactly; from round 2 on its inode is one the folder had before the save (a spare made
        # by the first save, or the pruned round's file), so no round after the first creates a model-sized file
        assert store.load("update", r, HASH) == b"".join(bytes(p) for p in _payload(r, BIG + 1000 * (r % 3)))
        if r >= 2:
            assert path.stat().st_ino in inodes_before_round[-1]
        files = sorted(p.name for p in folder.iterdir())
        stored = [f"update-r{k:06d}-{HASH[:16]}.msgpack" for k in range(max(1, r - KEEP + 1), r + 1)]
        # never more model-sized files than the store keeps: stored payloads and spares together at most KEEP
        spares = [f for f in files if f.startswith("update.spare")]
        assert sorted(set(files) - set(spares)) == stored and len(spares) == KEEP - len(stored)
        assert all(stat.S_IMODE((folder / f).stat().st_mode) == 0o600 for f in files)


def test_spares_are_never_loaded_and_are_dropped_once_the_store_is_full(tmp_path: Path) -> None:
    # Prepare: a site that crashed after its first save (two spares on disk), restarted, and saved on
    folder = tmp_path / "uplink"
    UplinkStore(folder).save("update", 1, HASH, b"a" * BIG)
    assert len(list(folder.glob("update.spare*"))) == KEEP - 1
    restarted = UplinkStore(folder)
    # Execute
    for r in (2, 3, 4):
        restarted.save("update", r, HASH, b"%d" % r * BIG)
    # Assert: the spares were taken, none is left, and only stored rounds load
    assert not list(folder.glob("update.spare*"))
    assert [restarted.load("update", r, HASH) for r in (1, 2, 3, 4)] == [None, *(b"%d" % r * BIG for r in (2, 3, 4))]


def test_a_failed_write_over_a_spare_leaves_every_kept_file_as_it_was(tmp_path: Path) -> None:
    # Prepare: round 1 stored, spares made
    store = UplinkStore(tmp_path / "uplink")
    store.save("update", 1, HASH, b"r1" * BIG)

    def pieces():  # noqa: ANN202
        yield b"partial " * 1000
        raise OSError("disk gone")

    # Execute
    with pytest.raises(OSError, match="disk gone"):
        store.save("update", 2, HASH, pieces())  # type: ignore[arg-type]  # an iterable of pieces
    # Assert: round 2 absent (never torn), round 1 intact
    assert store.load("update", 2, HASH) is None and store.load("update", 1, HASH) == b"r1" * BIG


def test_a_small_payload_gets_no_spares(tmp_path: Path) -> None:
    store = UplinkStore(tmp_path / "uplink")
    store.save("secagg", 1, "", b"tiny")
    assert sorted(p.name for p in (tmp_path / "uplink").iterdir()) == ["secagg-r000001-.msgpack"]


def test_make_spare_writes_a_private_file_of_the_size_once(tmp_path: Path) -> None:
    # Execute
    made = make_spare(tmp_path / "s", 3 * (1 << 20) + 5)
    again = make_spare(tmp_path / "s", 10)
    # Assert: the size asked, 0600, zeros; an existing file is left alone
    assert made and not again
    info = (tmp_path / "s").stat()
    assert info.st_size == 3 * (1 << 20) + 5 and stat.S_IMODE(info.st_mode) == 0o600
    assert (tmp_path / "s").read_bytes() == bytes(3 * (1 << 20) + 5)
