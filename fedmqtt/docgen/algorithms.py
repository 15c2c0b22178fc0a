"""docs/algorithms.md: sections 1-14 and 21 on rendered from each strategy's `ABOUT` (fedmqtt.strategies.about).

Only the text between each pair of marker lines is generated; everything around it (conventions, recruitment,
partitioners, evaluation, tables, sources) is written by hand in the same file. Sections 15-20 are hand-written
and cited by number, so strategies added later take numbers from 21 on, in a second generated part at the end.
"""

from __future__ import annotations

from fedmqtt.docgen import markers
from fedmqtt.docgen.paths import REPO

PATH = "docs/algorithms.md"
BEGIN = "<!-- BEGIN GENERATED: strategies (python -m fedmqtt.docgen) -->"
END = "<!-- END GENERATED: strategies -->"
BEGIN_LATER = "<!-- BEGIN GENERATED: later strategies (python -m fedmqtt.docgen) -->"
END_LATER = "<!-- END GENERATED: later strategies -->"
FIRST_HAND_WRITTEN = 15  # sections from here to 20 are written by hand


def strategy_sections(*, later: bool = False) -> str:
    """Sections 1-14 (or, `later`, 21 on), one per `ABOUT` record, separated like the hand-written sections."""
    from fedmqtt.strategies.about import all_docs, render_section

    docs = [d for d in all_docs() if (int(d.section) > FIRST_HAND_WRITTEN) == later]
    return "\n---\n\n".join(render_section(doc) for doc in docs)


def splice(text: str, generated: str) -> str:
    """`text` with what lies between the marker lines replaced by `generated`."""
    return markers.splice(text, generated, begin=BEGIN, end=END, path=PATH)


def render() -> dict[str, str]:
    """{"docs/algorithms.md": the committed file with its generated part brought up to date}."""
    text = (REPO / PATH).read_text(encoding="utf-8")
    text = splice(text, strategy_sections())
    text = markers.splice(text, strategy_sections(later=True), begin=BEGIN_LATER, end=END_LATER, path=PATH)
    return {PATH: text}
