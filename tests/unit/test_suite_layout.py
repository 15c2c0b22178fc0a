"""The test folders have no __init__.py, so pytest imports each test file by its basename: two files with one name
collect on separate xdist workers and fail as an "import file mismatch" once one process collects both (as CI's
did). This keeps the names unique."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_has_a_unique_basename() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        seen[path.name].append(str(path.relative_to(TESTS)))
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1 and name != "conftest.py"}
    assert not repeated, f"rename one of each: {repeated}"
