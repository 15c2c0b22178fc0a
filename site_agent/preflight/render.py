"""The checklist as people read it (aligned columns, the fix under each failure, colour only on a terminal) and
as machines read it (`--json`)."""

from __future__ import annotations

import json
import shutil
import textwrap

from site_agent.preflight.findings import Finding, Report

NAME_WIDTH = 11  # the longest check name, "credentials"
INDENT = " " * (2 + 4 + 2 + NAME_WIDTH + 2)  # under the "found" column
_COLOURS = {"pass": "1;32", "warn": "1;33", "fail": "1;31", "skip": "2"}  # ANSI: bold green, yellow, red; dim


class Checklist:
    """Formats findings one at a time (they are printed as each check ends: a slow network step shows where it
    is), then the summary. `width`: wrap at this many columns (a terminal's), None: never wrap (logs, pipes)."""

    def __init__(self, *, colour: bool, width: int | None) -> None:
        self.colour = colour
        self.width = width

    def header(self, config: str) -> str:
        return f"{self._bold('fedmqtt site check')}  {config}\n"

    def line(self, finding: Finding) -> str:
        tag = self._paint(finding.status, finding.status.upper().ljust(4))
        lines = self._wrap(f"  {tag}  {finding.check.ljust(NAME_WIDTH)}  ", finding.found, raw_prefix_len=len(INDENT))
        for detail in finding.details:
            lines += self._wrap(INDENT + "- ", detail, raw_prefix_len=len(INDENT) + 2)
        if finding.fix and finding.status in ("warn", "fail"):
            lines += self._wrap(INDENT + self._bold("fix: "), finding.fix, raw_prefix_len=len(INDENT) + 5)
        return "\n".join(lines)

    def summary(self, report: Report, config: str) -> str:
        n = report.counts()
        total = len(report.findings)
        parts = [f"{n['pass']} passed", _plural(n["warn"], "warning"), f"{n['fail']} failed"]
        if n["skip"]:
            parts.append(f"{n['skip']} skipped")
        counts = ", ".join(parts)
        start = f"`fedmqtt site start --config {config}`"
        if n["fail"]:
            text = f"{counts}: fix the FAIL lines above, then run the check again."
            return "\n" + self._paint("fail", text)
        if n["warn"]:
            return "\n" + self._paint("warn", f"{counts}: the site can join ({start}); read the warnings first.")
        return "\n" + self._paint("pass", f"All {total} checks passed: ready to join ({start}).")

    def _wrap(self, prefix: str, text: str, *, raw_prefix_len: int) -> list[str]:
        if self.width is None or self.width - raw_prefix_len < 30:
            return [prefix + text]
        body = textwrap.wrap(text, self.width - raw_prefix_len, break_on_hyphens=False, break_long_words=False)
        return [prefix + (body[0] if body else "")] + [" " * raw_prefix_len + rest for rest in body[1:]]

    def _paint(self, status: str, text: str) -> str:
        return f"\033[{_COLOURS[status]}m{text}\033[0m" if self.colour else text

    def _bold(self, text: str) -> str:
        return f"\033[1m{text}\033[0m" if self.colour else text


def terminal_width() -> int:
    return shutil.get_terminal_size((100, 24)).columns


def json_text(report: Report) -> str:
    return json.dumps(report.to_json(), indent=2)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
