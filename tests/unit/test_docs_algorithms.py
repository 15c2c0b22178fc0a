"""docs/algorithms.md: current with the strategies' ABOUT records, complete, and every cited section exists.

Also `fedmqtt algorithms NAME`, which prints the same section text in a terminal.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedmqtt.cli import app
from fedmqtt.docgen import REPO
from fedmqtt.docgen import algorithms as gen
from fedmqtt.strategies import STRATEGIES
from fedmqtt.strategies.about import about_of, all_docs, param_docs, render_section
from fedmqtt.strategies.strategy_doc import StrategyDoc

DOC = REPO / "docs" / "algorithms.md"
CITE = re.compile(r"docs/algorithms\.md(?: section)? ([0-9]+(?:\.[0-9]+)?)")


def _headings(text: str) -> set[str]:
    """Section numbers that head a markdown heading: "## 11 AdaFed" -> "11", "### 11.1 Setup" -> "11.1"."""
    return {m.group(1) for m in re.finditer(r"^#{2,4} ([0-9]+(?:\.[0-9]+)?) ", text, flags=re.MULTILINE)}


def _repo_files() -> list[Path]:
    """Tracked and untracked (not ignored) files of the repository, as git lists them."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [REPO / line for line in out.splitlines() if (REPO / line).is_file()]


def test_committed_file_equals_render() -> None:
    """Run `python -m fedmqtt.docgen` after changing a strategy's ABOUT or its parameters."""
    assert gen.render()[gen.PATH] == DOC.read_text(encoding="utf-8")


def test_generated_part_sits_between_the_markers_and_the_rest_is_kept() -> None:
    # Prepare
    text = f"head\n{gen.BEGIN}\nold\n{gen.END}\ntail\n"
    # Execute
    out = gen.splice(text, "## 1 New")
    # Check
    assert out == f"head\n{gen.BEGIN}\n\n## 1 New\n\n{gen.END}\ntail\n"
    with pytest.raises(ValueError, match="marker"):
        gen.splice("no markers here", "x")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_has_a_complete_about(name: str) -> None:
    doc = about_of(name)
    assert isinstance(doc, StrategyDoc) and name in doc.names
    for part in ("section", "title", "summary", "server", "client", "state"):
        assert getattr(doc, part).strip(), f"{name}: ABOUT.{part} is empty"
    assert doc.papers and all(p.strip() for p in doc.papers), f"{name}: no papers"
    assert doc.differences and all(d.strip() for d in doc.differences), f"{name}: no differences stated"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_parameter_table_matches_the_params_model(name: str) -> None:
    """Every field of the rule's Params, with its default, appears in its section; nothing else does."""
    section = render_section(about_of(name))
    fields = STRATEGIES[name].Params.model_fields
    rows = re.findall(r"^\| `([a-z_0-9]+)[^`]*` \| `([^`]*)` \|", section, flags=re.MULTILINE)
    documented = {param: default for param, default in rows}
    covered = {f for n in about_of(name).names for f in STRATEGIES[n].Params.model_fields}
    assert set(documented) == covered
    for field, info in fields.items():
        assert field in documented, f"{name}: parameter {field!r} missing from docs/algorithms.md"
        shown = next(p.default for p in param_docs(STRATEGIES[name].Params) if p.name.split(" ")[0] == field)
        assert documented[field] == shown
        assert info.description and info.description in section.replace("\\|", "|")
    if not covered:
        assert "no hyper-parameters" in section


def test_parameter_ranges_come_from_field_constraints() -> None:
    rows = {p.name.split(" ")[0]: p for p in param_docs(STRATEGIES["fedadam"].Params)}
    assert (rows["b1"].default, rows["b1"].valid) == ("0.9", "number [0, 1)")
    assert (rows["eta_g"].valid, rows["v_init"].valid) == ("number > 0", "number >= 0, or unset")
    assert rows["weighting"].valid == "one of samples, uniform"
    lam = param_docs(STRATEGIES["adafed"].Params)[0]
    assert (lam.name, lam.valid) == ("lam (or lambda)", "number (0, 1]")
    assert param_docs(STRATEGIES["feddyn"].Params)[2].default == "10"


def test_sections_one_to_fourteen_and_21_on_cover_every_registered_strategy_once() -> None:
    """Sections 15-20 are hand-written: strategies added later take 21 on (the second generated part)."""
    docs = all_docs()
    assert [d.section for d in docs] == [str(k) for k in (*range(1, 15), 21)]
    names = [n for d in docs for n in d.names]
    assert sorted(names) == sorted(STRATEGIES) and len(names) == len(set(names))
    text = DOC.read_text(encoding="utf-8")
    for d in docs:
        assert f"\n## {d.section} {d.title}\n" in text


def test_every_section_cited_in_the_repository_exists() -> None:
    headings = _headings(DOC.read_text(encoding="utf-8"))
    missing = []
    for path in _repo_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for number in CITE.findall(text):
            if number not in headings:
                missing.append(f"{path.relative_to(REPO)}: docs/algorithms.md {number}")
    assert not missing, "cited sections without a heading:\n" + "\n".join(sorted(set(missing)))


def test_the_conventions_and_closing_sections_are_there() -> None:
    headings = _headings(DOC.read_text(encoding="utf-8"))
    wanted = {f"0.{k}" for k in range(1, 9)} | {f"11.{k}" for k in range(1, 7)}
    wanted |= {f"16.{k}" for k in range(1, 6)} | {f"17.{k}" for k in range(1, 6)}
    wanted |= {"15", "16", "17", "18", "18.1", "18.2", "18.3", "19", "19.1", "19.2", "20"}
    assert wanted <= headings


def test_cli_prints_the_section_of_one_strategy() -> None:
    result = CliRunner().invoke(app, ["algorithms", "fedavg"])
    assert result.exit_code == 0, result.output
    assert result.output == render_section(about_of("fedavg"))
    assert result.output.startswith("## 1 FedAvg\n") and "num_batches_tracked" in result.output
    assert result.output in DOC.read_text(encoding="utf-8")


def test_cli_family_member_prints_its_family_section() -> None:
    result = CliRunner().invoke(app, ["algorithms", "fedadagrad"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("## 5 FedOpt") and "`b1`" in result.output


def test_cli_unknown_name_lists_the_known_ones() -> None:
    result = CliRunner().invoke(app, ["algorithms", "fedsgd"])
    assert result.exit_code == 2
    assert "unknown algorithm 'fedsgd'" in result.output
    for name in ("fedavg", "scaffold", "d-adafed", "central"):
        assert name in result.output


def test_cli_without_a_name_lists_every_strategy() -> None:
    result = CliRunner().invoke(app, ["algorithms"])
    assert result.exit_code == 0, result.output
    listed = {line.split()[0] for line in result.output.splitlines() if line and not line.startswith(" ")}
    assert set(STRATEGIES) | {"central"} <= listed
