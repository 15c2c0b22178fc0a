"""What the PS records in its audit log (`<out_dir>/audit/ps.jsonl`): how each start began (fresh, resumed,
forced) under which configuration hash, each round's accepted updates and refused messages, and the end.

One small append per round, at round close: it is written before the round's checkpoint, so a PS killed
between the two records the round again after `--resume` (the run-resume record between them says so) rather
than leaving it out.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from fedmqtt.audit.record import AuditError
from fedmqtt.audit.signing import Signer
from fedmqtt.audit.writer import AuditLog
from ps_daemon.config import DaemonConfig
from ps_daemon.state import DaemonState, RoundRecord

log = logging.getLogger("fedmqtt.ps")
AUDIT_FILE = Path("audit") / "ps.jsonl"  # under out_dir; `--force` removes checkpoints, never this
ACTOR = "ps"
MAX_CATEGORIES = 16  # refusal categories per record (the known ones are fewer; the rest are summed as "other")
START_EVENTS = {"fresh": "run-start", "resume": "run-resume", "force": "run-force-restart"}
StartMode = Literal["fresh", "resume", "force"]


def refusal_totals(by_category: Mapping[str, int], by_site: Iterable[Mapping[str, int]]) -> Counter[str]:
    """All refusals so far by category: the channel's (all senders together) and the PS's own (per site)."""
    total: Counter[str] = Counter(by_category)
    for reasons in by_site:
        total.update(reasons)
    return total


class RunAudit:
    """The PS's audit records for one process (refusals are counted from this process's start)."""

    def __init__(self, config: DaemonConfig, signer: Signer | None = None) -> None:
        self.config = config
        self.log = AuditLog(config.out_dir / AUDIT_FILE, chain=f"ps/{config.run_id}", actor=ACTOR, signer=signer)
        self._refused_before: Counter[str] = Counter()

    def started(self, mode: StartMode, state: DaemonState, *, removed_checkpoints: int = 0) -> None:
        c = self.config
        details: dict[str, Any] = {"run_id": c.run_id, "config_hash": c.config_hash(), "algorithm": c.algorithm,
                                   "rounds": c.rounds, "sites": len(c.sites), "session": state.session}
        if mode == "resume":
            details["round"] = state.round  # 1 when no round had closed (no checkpoint: started from the config)
            details["phase"] = state.phase
        if mode == "force":
            details["removed_checkpoints"] = removed_checkpoints
        self.log.append(START_EVENTS[mode], **details)

    def round_closed(self, record: RoundRecord, refused_total: Counter[str]) -> None:
        """One record per closed round: refusals are those since the previous round closed (or the start)."""
        refused = refused_total - self._refused_before
        self._refused_before = Counter(refused_total)
        shown = dict(refused.most_common(MAX_CATEGORIES))
        other = sum(refused.values()) - sum(shown.values())
        if other:
            shown["other"] = other
        self.log.append("round-close", round=record.round, accepted=len(record.sites),
                        stragglers=len(record.stragglers), refused=shown, model_hash=record.model_hash,
                        duration_s=round(record.closed_at - record.started_at, 3))

    def finished(self, state: DaemonState) -> None:
        best = state.best.round if state.best is not None else None
        self.log.append("run-finish", run_id=self.config.run_id, session=state.session, rounds=len(state.history),
                        best_round=best, model_hash=state.model_hash)

    def stopped(self, state: DaemonState, *, signalled: bool) -> None:
        """Best effort: this runs while the PS stops, perhaps because the disk is full; the stop must go on."""
        try:
            self.log.append("run-stop", session=state.session, round=state.round, phase=state.phase,
                            cause="signal" if signalled else "error")
        except AuditError as exc:
            log.error("the audit record of this stop was not written: %s", exc)
