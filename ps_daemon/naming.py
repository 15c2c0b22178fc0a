"""Site names in one line of text: hundreds may be missing, so a line names a few and counts the rest."""

from __future__ import annotations

NAMES_SHOWN = 8  # site names in one line of text


def named(sites: list[str] | tuple[str, ...]) -> str:
    more = f" and {len(sites) - NAMES_SHOWN} more" if len(sites) > NAMES_SHOWN else ""
    return ", ".join(sites[:NAMES_SHOWN]) + more
