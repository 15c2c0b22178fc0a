"""Finished run directories: finding them under an output folder, reading their report and audit log, and the
few files a browser may download from them.

Downloads are a fixed list of names the PS writes into its out_dir; the directory comes from the command line,
never from a request, and a name is opened only if it is a regular file in that directory itself (no symbolic
link, no sub-folder), so no request can reach any other file.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

from fedmqtt.errors import FedMqttError

REPORT = "report.json"
AUDIT = Path("audit") / "ps.jsonl"


@dataclass(frozen=True)
class Download:
    content_type: str
    what: str


# name -> what it is; the only files ever served from a run directory (ps_daemon/final_outputs.py writes them)
DOWNLOADS: dict[str, Download] = {
    "report.json": Download("application/json", "the whole report"),
    "report.md": Download("text/markdown; charset=utf-8", "the report as Markdown"),
    "per_site.csv": Download("text/csv; charset=utf-8", "final val/test metrics per site"),
    "final_model.safetensors": Download("application/octet-stream", "the final model"),
    "best_model.safetensors": Download("application/octet-stream", "the best round's model"),
}
MAX_RUNS = 100  # runs listed from one --runs folder (the newest)
MAX_DEPTH = 3  # --runs DIR finds DIR/report.json, DIR/a/report.json, ... down to three folders deep
# Folders a PS or a grid writes that never hold a run of their own
NOT_RUNS = frozenset({"checkpoints", "state", "spool", "audit", "partitions", "configs", "logs", "federation"})
MAX_REPORT_BYTES = 256 * 1024 * 1024
MAX_AUDIT_BYTES = 16 * 1024 * 1024
MAX_AUDIT_LINE = 16 * 1024  # fedmqtt.audit.record.MAX_LINE_BYTES: no writer writes more
CHUNK = 1 << 20


def find_runs(folder: Path) -> list[Path]:
    """Run directories (holding report.json) in `folder` and below it, newest report first, at most MAX_RUNS."""
    if not folder.is_dir():
        raise FedMqttError(f"--runs {folder}: not a folder")
    found: list[Path] = []

    def walk(path: Path, depth: int) -> None:
        if (path / REPORT).is_file():
            found.append(path)
        if depth == MAX_DEPTH:
            return
        try:
            children = sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink() and p.name not in NOT_RUNS)
        except OSError:
            return  # unreadable: not ours to list
        for child in children:
            walk(child, depth + 1)

    walk(folder, 0)
    if not found:
        raise FedMqttError(f"--runs {folder}: no report.json in it or in its sub-folders (down to {MAX_DEPTH} deep)")
    found.sort(key=lambda p: (p / REPORT).stat().st_mtime, reverse=True)
    return found[:MAX_RUNS]


def read_report(directory: Path) -> dict[str, Any]:
    path = directory / REPORT
    if not path.is_file():
        raise FedMqttError(f"{path} not found: a finished run directory (the PS's out_dir) holds report.json")
    if path.stat().st_size > MAX_REPORT_BYTES:
        raise FedMqttError(f"{path} is larger than {MAX_REPORT_BYTES >> 20} MiB: not a report this version reads")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FedMqttError(f"{path} is not a report.json this version can read: {exc}") from None
    if not isinstance(report, dict):
        raise FedMqttError(f"{path} is not a report.json this version can read: not a JSON object")
    return report


def read_audit(directory: Path) -> list[dict[str, Any]]:
    """The PS's audit records (event, details, t in seconds), read defensively: a missing, oversized or damaged
    log gives what could be read. Not verified here: `fedmqtt audit verify` checks the hash chain."""
    path = directory / AUDIT
    try:
        st = path.lstat()
    except OSError:
        return []
    if not stat.S_ISREG(st.st_mode):
        return []
    records: list[dict[str, Any]] = []
    with open(path, "rb") as fh:
        for line in _lines(fh, MAX_AUDIT_BYTES):
            try:
                record = json.loads(line)
                details = record.get("details") if isinstance(record.get("details"), dict) else {}
                t = datetime.strptime(record["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
            records.append({"event": str(record.get("event", "")), "details": details, "t": t})
    return records


def _lines(fh: BinaryIO, budget: int) -> Iterator[bytes]:
    while budget > 0:
        line = fh.readline(MAX_AUDIT_LINE + 1)
        if not line:
            return
        budget -= len(line)
        if len(line) <= MAX_AUDIT_LINE:
            yield line


def available(directory: Path) -> list[dict[str, Any]]:
    """The downloads this run directory has: name, size, what it is."""
    out = []
    for name, download in DOWNLOADS.items():
        opened = open_download(directory, name)
        if opened is not None:
            fh, size = opened
            fh.close()
            out.append({"name": name, "bytes": size, "what": download.what})
    return out


def open_download(directory: Path, name: str) -> tuple[BinaryIO, int] | None:
    """One of DOWNLOADS, opened for reading, with its size; None for any other name or anything but a regular
    file directly in `directory` (a symbolic link is refused by the open itself: O_NOFOLLOW)."""
    if name not in DOWNLOADS:
        return None
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(directory / name, flags)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # a FIFO or device planted under the name: never read it
        os.close(fd)
        return None
    return os.fdopen(fd, "rb"), st.st_size

