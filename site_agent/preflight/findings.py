"""One check's outcome and the report of all of them: what `fedmqtt site check` prints and how it exits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["pass", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("pass", "warn", "fail", "skip")


@dataclass(frozen=True)
class Finding:
    """`found`: one line on what the check saw; `fix`: the exact change that makes it pass (WARN and FAIL);
    `details`: further lines worth reading (a data loader's notes); `facts`: the numbers, for `--json`."""

    check: str
    status: Status
    found: str
    fix: str = ""
    details: tuple[str, ...] = ()
    facts: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "status": self.status, "found": self.found, "fix": self.fix,
                "details": list(self.details), "facts": self.facts}


def passed(check: str, found: str, **facts: Any) -> Finding:
    return Finding(check, "pass", found, facts=facts)


def warned(check: str, found: str, fix: str, **facts: Any) -> Finding:
    return Finding(check, "warn", found, fix, facts=facts)


def failed(check: str, found: str, fix: str, **facts: Any) -> Finding:
    return Finding(check, "fail", found, fix, facts=facts)


def skipped(check: str, why: str) -> Finding:
    return Finding(check, "skip", why)


@dataclass
class Report:
    config: str
    site_id: str = ""
    run_id: str = ""
    findings: list[Finding] = field(default_factory=list)

    def counts(self) -> dict[Status, int]:
        return {s: sum(f.status == s for f in self.findings) for s in STATUSES}

    @property
    def exit_code(self) -> int:
        """1 when any check failed; warnings alone exit 0 (the agent would run, with the caveats shown)."""
        return 1 if self.counts()["fail"] else 0

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "site_id": self.site_id, "run_id": self.run_id,
                "ok": self.exit_code == 0, "exit_code": self.exit_code, "counts": self.counts(),
                "checks": [f.to_json() for f in self.findings]}
