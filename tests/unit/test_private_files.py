"""What a party writes is its own: 0600 files and 0700 folders whatever the umask, and a credentials file that
others can read is refused at load, with the chmod that fixes it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedmqtt.atomic import private_dir, replace_atomic, write_atomic, write_private_text
from fedmqtt.config_io import dump_toml
from fedmqtt.errors import ConfigError
from fedmqtt.transport.settings import load_credentials
from site_agent.local_state import BestSlot
from site_agent.store import UplinkStore


@pytest.fixture
def open_umask() -> Iterator[None]:
    """umask 0: without our own modes, every file would be 0666 and every folder 0777."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_atomic_writes_are_private_whatever_the_umask(tmp_path: Path, open_umask: None) -> None:
    write_atomic(tmp_path / "a.bin", b"x")
    write_atomic(tmp_path / "b.bin", [b"x", memoryview(b"y")], durable=False)
    write_private_text(tmp_path / "report.md", "# report")
    replace_atomic(tmp_path / "c.bin", lambda tmp: Path(tmp).write_bytes(b"z"))  # a writer that truncates
    assert {p.name: _mode(p) for p in tmp_path.iterdir()} == {n: 0o600 for n in ("a.bin", "b.bin", "report.md",
                                                                                  "c.bin")}


def test_private_dir_makes_and_tightens_the_partys_folders(tmp_path: Path, open_umask: None) -> None:
    assert _mode(private_dir(tmp_path / "new" / "state")) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    assert _mode(private_dir(loose)) == 0o700


def test_site_state_is_private(tmp_path: Path, open_umask: None) -> None:
    """A site's uplinks and best model: folders 0700, files 0600."""
    store = UplinkStore(tmp_path / "uplink")
    store.save("update", 1, "ab" * 32, b"payload")
    best = BestSlot(tmp_path / "best")
    best.remember(1, {"w": np.zeros(3, dtype=np.float32)})
    for path in [tmp_path / "uplink", tmp_path / "best", *(tmp_path / "uplink").iterdir(),
                 *(tmp_path / "best").iterdir()]:
        assert _mode(path) == (0o700 if path.is_dir() else 0o600), path


def _credentials(path: Path, mode: int) -> Path:
    path.write_text(dump_toml({"broker": {"username": "site-a", "password": "secret"}}))
    path.chmod(mode)
    return path


@pytest.mark.parametrize(("mode", "who"), [(0o640, "its group"), (0o604, "other users"),
                                           (0o660, "its group"), (0o644, "its group and other users")])
def test_a_credentials_file_others_can_read_is_refused_with_the_fix(tmp_path: Path, mode: int, who: str) -> None:
    path = _credentials(tmp_path / "site-a.toml", mode)
    with pytest.raises(ConfigError, match=f"open to {who}") as caught:
        load_credentials(path)
    assert f"chmod 600 {path}" in str(caught.value)
    path.chmod(0o600)
    assert load_credentials(path).username == "site-a"
