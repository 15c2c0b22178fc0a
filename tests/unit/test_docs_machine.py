"""docs/design-notes.md: the PS's phases and events are the transition table the machine dispatches through."""

from __future__ import annotations

import pytest

from fedmqtt.docgen import REPO, stale
from fedmqtt.docgen import machine as gen
from ps_daemon.transitions import TRANSITIONS

DOC = REPO / gen.PATH


def test_committed_file_equals_render() -> None:
    """Run `python -m fedmqtt.docgen` after changing ps_daemon/transitions.py."""
    assert gen.render()[gen.PATH] == DOC.read_text(encoding="utf-8")
    assert gen.PATH not in stale()  # and `python -m fedmqtt.docgen` writes it


def test_every_row_of_the_table_is_in_the_doc() -> None:
    text = DOC.read_text(encoding="utf-8").split(gen.BEGIN, 1)[1].split(gen.END, 1)[0]
    for (phase, event), t in TRANSITIONS.items():
        row = f"| `{phase}` | `{event.__name__}` | "
        assert row in text and f"| `{t.handler}` |" in text, row


def test_only_the_marked_part_is_generated() -> None:
    # Prepare
    text = f"hand-written\n{gen.BEGIN}\nold table\n{gen.END}\nmore by hand\n"
    # Execute
    out = gen.markers.splice(text, "new", begin=gen.BEGIN, end=gen.END, path=gen.PATH)
    # Check
    assert out == f"hand-written\n{gen.BEGIN}\n\nnew\n\n{gen.END}\nmore by hand\n"
    with pytest.raises(ValueError, match="marker"):
        gen.markers.splice(text + gen.END, "x", begin=gen.BEGIN, end=gen.END, path=gen.PATH)
