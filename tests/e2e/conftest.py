"""Fixtures for end-to-end tests: federations driven through the CLI (see harness.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import CliFederation, stop_federations


@pytest.fixture
def cli_federation(mosquitto_bin: str, tmp_path: Path) -> Iterator[Callable[..., CliFederation]]:
    made: list[CliFederation] = []

    def make(name: str, **kw: object) -> CliFederation:
        fed = CliFederation(tmp_path / name, **kw)  # type: ignore[arg-type]
        made.append(fed)
        return fed

    yield make
    stop_federations(made)  # all at once: a test with two federations waits for the slowest process only
