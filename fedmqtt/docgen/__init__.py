"""Generated documentation: docs that are made from the code so they cannot drift.

Each module here has `render() -> dict[str, str]`: repository-relative path -> the file's full content.
`python -m fedmqtt.docgen` writes them; `python -m fedmqtt.docgen --check` lists stale ones (CI runs the check
as a test)."""

from __future__ import annotations

from pathlib import Path

from fedmqtt.docgen.paths import REPO

__all__ = ["REPO", "rendered", "stale"]


def rendered() -> dict[str, str]:
    """Every generated file, from every generator."""
    from fedmqtt.docgen import algorithms, configuration, machine, monitoring, protocol

    out: dict[str, str] = {}
    for module in (algorithms, protocol, configuration, machine, monitoring):
        out.update(module.render())
    return out


def stale(root: Path = REPO) -> list[str]:
    """Generated files whose content on disk differs from what the code makes now."""
    return [rel for rel, text in rendered().items()
            if not (root / rel).is_file() or (root / rel).read_text(encoding="utf-8") != text]
