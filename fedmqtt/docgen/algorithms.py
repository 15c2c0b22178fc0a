"""docs/algorithms.md: sections 1-14 rendered from each strategy's `ABOUT` (fedmqtt.strategies.about).

Only the text between the two marker lines is generated; everything around it (conventions, recruitment,
partitioners, evaluation, tables, sources) is written by hand in the same file.
"""

from __future__ import annotations

from fedmqtt.docgen import markers
from fedmqtt.docgen.paths import REPO

PATH = "docs/algorithms.md"
BEGIN = "<!-- BEGIN GENERATED: strategies (python -m fedmqtt.docgen) -->"
END = "<!-- END GENERATED: strategies -->"


def strategy_sections() -> str:
    """Sections 1-14, one per `ABOUT` record, separated like the hand-written sections."""
    from fedmqtt.strategies.about import all_docs, render_section

    return "\n---\n\n".join(render_section(doc) for doc in all_docs())


def splice(text: str, generated: str) -> str:
    """`text` with what lies between the marker lines replaced by `generated`."""
    return markers.splice(text, generated, begin=BEGIN, end=END, path=PATH)


def render() -> dict[str, str]:
    """{"docs/algorithms.md": the committed file with its generated part brought up to date}."""
    text = (REPO / PATH).read_text(encoding="utf-8")
    return {PATH: splice(text, strategy_sections())}
