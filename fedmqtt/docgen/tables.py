"""Markdown helpers shared by the generators: tables whose cells cannot break the table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def cell(value: object) -> str:
    """One table cell: pipes escaped, line breaks folded into spaces."""
    return " ".join(str(value).split()).replace("|", "\\|")


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table, ending in a newline."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def code(text: object) -> str:
    """Inline code; empty text becomes an em dash so a cell is never blank."""
    text = str(text)
    return f"`{text}`" if text else "—"


def size(value: object) -> str:
    """A byte count with its binary unit when it is a whole number of them: 4194304 -> 4 MiB."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024:
        for unit, step in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % step == 0:
                return f"{value // step} {unit}"
    return str(value)
