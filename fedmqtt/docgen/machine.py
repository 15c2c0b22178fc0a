"""docs/design-notes.md, section PS: the PS's phases and events, rendered from the transition table that
`Machine.step` dispatches through (ps_daemon.transitions), so the description is the code's.

Only the text between the two marker lines is generated; the rest of the file is written by hand.
"""

from __future__ import annotations

from fedmqtt.docgen import markers
from fedmqtt.docgen.paths import REPO
from fedmqtt.docgen.tables import code, table
from ps_daemon.transitions import EVENTS, PHASES, TRANSITIONS

PATH = "docs/design-notes.md"
BEGIN = "<!-- BEGIN GENERATED: PS transitions (python -m fedmqtt.docgen) -->"
END = "<!-- END GENERATED: PS transitions -->"

INTRO = """### Phases and events

What each event does in each phase of the PS (`ps/status` `state`), and the phases it can leave the PS in.
This is the table `ps_daemon.transitions.TRANSITIONS`, through which `Machine.step` dispatches: the handler
named in a row is the `Machine` method that runs (the secure-aggregation ones, `_secagg_in_round` and
`_refuse_secagg`, come from `ps_daemon.machine_secagg`). A run goes `waiting_for_sites` -> `training` (rounds 1
to R) -> `evaluating` (the final model) -> `done`; `offline` and `error` are published by the runner, not the
machine.
"""


def transition_table() -> str:
    """One row per phase and event, phases in their order, events in the order `Event` lists them."""
    rows = []
    for phase in PHASES:
        for event in EVENTS:
            t = TRANSITIONS[phase, event]
            rows.append((code(phase), code(event.__name__), t.does, ", ".join(code(p) for p in t.next_phases),
                         code(t.handler)))
    return table(("phase", "event", "what the PS does", "next phase", "handler"), rows)


def render() -> dict[str, str]:
    """{"docs/design-notes.md": the committed file with its generated part brought up to date}."""
    text = (REPO / PATH).read_text(encoding="utf-8")
    return {PATH: markers.splice(text, f"{INTRO}\n{transition_table()}", begin=BEGIN, end=END, path=PATH)}
