"""Every file the project names exists in the repository, and nothing points outside it.

Scanned: the code and tests (*.py), README.md, docs/**/*.md, and every command's help text. Checked:
- a repository path (`docs/protocol.md`, `fedmqtt/cli/ps.py`, `tests/e2e/harness.py`...) names a file that exists;
- a relative Markdown link in README.md or docs/ resolves to a file;
- no reference to the reference material kept outside the repository (its docs folder, its design and style
  notes, a bare algorithms document without `docs/`);
- every "docs/algorithms.md N" or "N.M" citation names a heading of docs/algorithms.md.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("fedmqtt", "broker", "ps_daemon", "site_agent", "schemas", "bench", "scripts", "tests")
SKIP_PARTS = {".venv", "__pycache__", "node_modules", ".git", ".hypothesis", "runs"}

REPO_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join((*CODE_DIRS, "docs")) + r")/[\w./-]*\w\."
                       r"(?:py|md|toml|json|sh|ya?ml|txt|csv|png|svg))(?![\w*{<])")
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
OUTSIDE = {
    "the outside docs folder": re.compile(r"\.\./shared/docs"),
    "the outside developer notes": re.compile(r"(?<![\w-])DEVELOPERS\.md"),
    "the outside design notes": re.compile(r"(?<![\w-])design\.md"),
    "the outside style notes": re.compile(r"(?<![\w-])style\.md"),
    "a bare algorithms document (write docs/algorithms.md)": re.compile(r"(?<![\w/-])algorithms\.md"),
}
CITATION = re.compile(r"docs/algorithms\.md,?\s+(?:section\s+|§\s*)?(\d+(?:\.\d+)?)(?![\d.]*\w)")


def sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "mosquitto.conf", ROOT / "pyproject.toml",
             *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in CODE_DIRS:
        files.extend(p for p in sorted((ROOT / folder).rglob("*.py")) if not SKIP_PARTS & set(p.parts))
    return [f for f in files if f.is_file()]


@cache
def help_texts() -> str:
    """Every command's help, epilog and parameter help, as one text (what `--help` prints)."""
    from fedmqtt.cli import app

    texts: list[str] = []

    def walk(command: Any) -> None:
        texts.extend([command.help or "", command.epilog or ""])
        texts.extend(getattr(p, "help", None) or "" for p in command.params)
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(app))
    return "\n".join(texts)


def read(path: Path) -> str:
    """The file's text; in Python, pathlib joins (ROOT / "docs" / "protocol.md") read as the path they build."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return re.sub(r"(['\"])\s*/\s*\1", "/", text) if path.suffix == ".py" else text


def texts() -> list[tuple[str, str]]:
    """(where, text) for every scanned file and the help texts."""
    out = [(str(p.relative_to(ROOT)), read(p)) for p in sources()]
    return [*out, ("fedmqtt --help (all commands)", help_texts())]


def exists(name: str, where: str) -> bool:
    """At the repository root, beside the file that names it, or under docs/ (generated docs' sources)."""
    folder = (ROOT / where).parent if (ROOT / where).is_file() else ROOT
    return any((base / name).exists() for base in (ROOT, folder, ROOT / "docs"))


@cache
def algorithm_headings() -> set[str]:
    doc = ROOT / "docs" / "algorithms.md"
    if not doc.is_file():
        return set()
    return set(re.findall(r"^#{1,4}\s+(\d+(?:\.\d+)?)\b", doc.read_text(encoding="utf-8"), flags=re.M))


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_the_scan_sees_code_docs_and_help() -> None:
    """The scan covers what it claims to: the package, the docs and the help texts."""
    names = {where for where, _ in texts()}
    assert {"README.md", "fedmqtt/cli/__init__.py", "docs/protocol.md"} <= names
    assert "docs/algorithms.md" in help_texts()


def test_the_patterns_catch_what_they_should() -> None:
    """The checks can fail: made-up mentions are caught, the project's own paths are not."""
    nowhere = "docs/" + "nowhere.md"  # split, so this file does not name it
    assert [m.group(1) for m in REPO_PATH.finditer(f"see {nowhere} and `fedmqtt/cli/ps.py`.")] == [
        nowhere, "fedmqtt/cli/ps.py"]
    bad = ["(../shared/" + "docs/x)", "see DEVELOPERS" + ".md", "see design" + ".md", "per algorithms" + ".md 15"]
    assert all(any(p.search(b) for p in OUTSIDE.values()) for b in bad)
    good = "docs/algorithms.md 15, docs/design-notes.md, docs/protocol.md"
    assert not any(p.search(good) for p in OUTSIDE.values())
    cited = "docs/algorithms.md section 17.1; docs/algorithms.md 15 DECISION; docs/algorithms.md 0.2)."
    assert [m.group(1) for m in CITATION.finditer(cited)] == ["17.1", "15", "0.2"]
    assert not [m.group(1) for m in CITATION.finditer("docs/algorithms.md 2x")]
    assert {"0.1", "15", "17.1", "19.2"} <= algorithm_headings()


def test_every_repository_path_mentioned_exists() -> None:
    missing = []
    for where, text in texts():
        for m in REPO_PATH.finditer(text):
            if not exists(m.group(1), where):
                missing.append(f"{where}:{line_of(text, m.start())}: {m.group(1)}")
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)


def test_markdown_links_resolve() -> None:
    broken = []
    for path in [p for p in sources() if p.suffix == ".md"]:
        text = path.read_text(encoding="utf-8")
        for m in MD_LINK.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}:{line_of(text, m.start())}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_nothing_points_outside_the_repository() -> None:
    found = []
    for where, text in texts():
        for what, pattern in OUTSIDE.items():
            for m in pattern.finditer(text):
                found.append(f"{where}:{line_of(text, m.start())}: {what}: ...{text[max(0, m.start() - 30):m.end()]}")
    assert not found, "references outside the repository:\n" + "\n".join(found)


def test_algorithm_citations_name_existing_sections() -> None:
    headings = algorithm_headings()
    if not headings:
        pytest.fail("docs/algorithms.md is missing or has no numbered headings")
    wrong = []
    for where, text in texts():
        for m in CITATION.finditer(text):
            if m.group(1) not in headings:
                wrong.append(f"{where}:{line_of(text, m.start())}: docs/algorithms.md {m.group(1)}")
    assert not wrong, "citations of sections docs/algorithms.md does not have:\n" + "\n".join(wrong)
