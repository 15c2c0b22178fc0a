"""What differential privacy cost each run of `fedmqtt report`: the participant-level epsilon its released models
had at the end (DP-FedAvg, `privacy.participant_level.final` of its report.json) beside the largest record-level
epsilon a site reported (DP-SGD, `privacy.record_level`), each at its delta. Entries are validated as the wire's
ParticipantSpent and PrivacySpent; one that does not validate is shown as "invalid", never used."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from fedmqtt.experiments.runs import RunRecord
from fedmqtt.experiments.tables import align, markdown_rows
from schemas import messages as m

HEADER = ["run", "algorithm", "seed", "participant-level epsilon (final)", "record-level epsilon (largest site)"]


def privacy_rows(records: Sequence[RunRecord]) -> list[list[str]]:
    """A header and a row per run that used DP; only the header when none did."""
    rows = [HEADER]
    for r in records:
        try:
            privacy = json.loads((r.path / "report.json").read_text()).get("privacy")
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(privacy, dict):
            continue
        participant, record = _participant(privacy.get("participant_level")), _record(privacy.get("record_level"))
        if participant != "–" or record != "–":
            rows.append([r.path.name, r.algorithm, str(r.seed), participant, record])
    return rows


def privacy_text(records: Sequence[RunRecord]) -> str:
    rows = privacy_rows(records)
    return "" if len(rows) == 1 else "differential privacy (epsilon at delta, docs/privacy.md)\n" + align(rows)


def privacy_markdown(records: Sequence[RunRecord]) -> str:
    rows = privacy_rows(records)
    if len(rows) == 1:
        return ""
    return "\n".join(["## Differential privacy (epsilon at delta, docs/privacy.md)", "", *markdown_rows(rows), ""])


def _participant(section: Any) -> str:
    if not isinstance(section, dict) or section.get("final") is None:
        return "–"
    try:
        p = m.ParticipantSpent.model_validate(section["final"])
    except ValidationError:
        return "invalid"
    return f"{p.epsilon:.3g} at {p.delta:g} after {p.rounds} rounds ({p.accountant})"


def _record(section: Any) -> str:
    if not isinstance(section, dict) or not section:
        return "–"
    try:
        spent = [m.PrivacySpent.model_validate(v) for v in section.values()]
    except ValidationError:
        return "invalid"
    worst = max(spent, key=lambda p: p.epsilon)
    return f"{worst.epsilon:.3g} at {worst.delta:g} ({len(spent)} site{'s' * (len(spent) != 1)})"
