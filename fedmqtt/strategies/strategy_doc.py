"""The record of what a strategy does (`StrategyDoc`), which every strategy module keeps as its `ABOUT`.

Only the data: rendering and lookup by name live in `fedmqtt.strategies.about`, which needs the registry, and
the registry imports every strategy module (keeping them apart leaves no import loop).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Subsection:
    """A numbered part of a strategy's section that the code cites on its own (e.g. 11.1 for AdaFed)."""

    number: str
    title: str
    text: str


@dataclass(frozen=True)
class StrategyDoc:
    """The reference text of one section of docs/algorithms.md (one strategy or a family of them).

    Formulas (`server`, `client`) are plain text, one statement a line, rendered as a code block so they
    read the same in a terminal and on a web page. `names` are the registry names the section covers.
    """

    section: str
    title: str
    names: tuple[str, ...]
    summary: str
    server: str
    client: str
    state: str
    papers: tuple[str, ...]
    differences: tuple[str, ...]
    example: str = ""
    subsections: tuple[Subsection, ...] = ()
