"""Every `fedmqtt` command and sub-command, found from the typer app: --help works and reads cleanly.

What a new user reads first. Checked for each command: `--help` exits 0; every option and argument has a
help text; no text loses characters to rich markup (a "[broker]" rendered as "( table)"); no help
paragraph breaks mid-sentence (rich keeps a docstring's line breaks; fedmqtt.cli reflows them).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
import typer
from rich.text import Text
from typer.testing import CliRunner

from fedmqtt.cli import app

ROOT = typer.main.get_command(app)


def walk(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(path, command) for the root, every group and every sub-command (typer's own click objects)."""
    found = [(path, command)]
    if hasattr(command, "commands"):  # a group
        for name, sub in sorted(command.commands.items()):
            found.extend(walk(sub, (*path, name)))
    return found


COMMANDS = walk(ROOT)
IDS = [" ".join(path) or "fedmqtt" for path, _ in COMMANDS]


def test_every_command_group_is_found() -> None:
    """The walk reaches the deployed roles' sub-commands, so a new command is checked without a list."""
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"broker init", "ps start", "site start", "topics watch", "partition", "recruit", "simulate"} <= names


def lost_to_markup(text: str) -> bool:
    """True when rich markup would swallow part of `text` (e.g. "[broker]"); an escaped "\\[" is fine."""
    return Text.from_markup(text).plain != text.replace("\\[", "[")


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=IDS)
def test_help_exits_0_and_every_parameter_is_described(path: tuple[str, ...], command: Any) -> None:
    # Execute
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "100"}, terminal_width=100)
    # Assert
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    assert not re.search(r"\(\s+\w+\)", result.output), f"markup glitch in:\n{result.output}"
    undescribed = [p.name for p in command.params if not (getattr(p, "help", None) or "").strip()]
    assert not undescribed, f"{' '.join(path)}: parameters without help: {undescribed}"
    texts = [command.help or "", *(getattr(p, "help", None) or "" for p in command.params)]
    assert not [t for t in texts if lost_to_markup(t)], f"{' '.join(path)}: help text eaten by rich markup"
    paragraphs = inspect.cleandoc(command.help or "").split("\n\n")
    assert paragraphs[0].strip(), f"{' '.join(path) or 'fedmqtt'} has no help text"
    broken = [p for p in paragraphs if "\n" in p and not p.startswith("\b")
              and not any(line[:1].isspace() for line in p.splitlines())]
    assert not broken, f"{' '.join(path)}: help paragraphs with hard line breaks:\n{broken}"


def test_no_help_points_outside_the_repository() -> None:
    """Help cites the project's own docs by path, never a document the repository does not have."""
    outside = re.compile(r"\.\./shared|DEVELOPERS\.md|design\.md|(?<!docs/)algorithms\.md")
    for path, command in COMMANDS:
        texts = [command.help or "", command.epilog or "", *(getattr(p, "help", None) or "" for p in command.params)]
        assert not [t for t in texts if outside.search(t)], " ".join(path)
