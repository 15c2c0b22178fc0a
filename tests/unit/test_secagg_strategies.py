"""Which strategies run under secure aggregation: declared in code by every strategy, printed by
`fedmqtt algorithms`, and stated in docs/secure-aggregation.md (kept in step here), as are the graph parameters
that page quotes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedmqtt.cli import app
from fedmqtt.secagg.graph import choose
from fedmqtt.strategies import STRATEGIES
from fedmqtt.strategies.rule import ServerRule

DOC = Path(__file__).resolve().parents[2] / "docs" / "secure-aggregation.md"
# rules that need each site's own data (DP-FedAvg: its server clips each site's change)
PER_SITE = {"fedadp", "feddkw", "adafed", "d-adafed", "f-adafed", "dp-fedavg"}


def doc_table(header: str) -> list[list[str]]:
    """The rows of the markdown table that starts with `header` in docs/secure-aggregation.md."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_every_strategy_declares_whether_it_needs_only_sums() -> None:
    for name, cls in STRATEGIES.items():
        declared = next(c for c in cls.__mro__ if "needs_only_sums" in vars(c))
        assert declared is not ServerRule, f"{name} inherits the undeclared default"
        assert cls.sums_note and cls.sums_note != ServerRule.sums_note, name
        assert cls.needs_only_sums is (name not in PER_SITE), name


def test_the_page_says_what_the_code_declares() -> None:
    rows = {row[0]: row[1] for row in doc_table("| algorithm | under secure aggregation |")}
    assert set(rows) == set(STRATEGIES)
    for name, cls in STRATEGIES.items():
        assert rows[name].split(":")[0].split(" ")[0] == ("yes" if cls.needs_only_sums else "no"), name
        assert ("from the weighted mean" in rows[name]) is cls.from_weighted_mean, name
        assert ("from the plain mean" in rows[name]) is cls.sums_uniform, name


def test_fedmqtt_algorithms_prints_it() -> None:
    result = CliRunner().invoke(app, ["algorithms"])
    assert result.exit_code == 0, result.output
    assert result.output.count("secure aggregation: yes") == len(STRATEGIES) - len(PER_SITE)
    assert result.output.count("secure aggregation: no") == len(PER_SITE)
    assert re.search(r"fedadp .*\n(?: .*\n)*? +secure aggregation: no: the weights come from the angle", result.output)


@pytest.mark.parametrize("row", doc_table("| sites n | degree k |"))
def test_the_pages_graph_parameters_are_the_codes(row: list[str]) -> None:
    n, degree, threshold, failure = row
    params = choose(int(n), 0.1)
    assert (params.degree, params.threshold) == (int(degree.split(" ")[0]), int(threshold))
    assert f"{params.failure_probability:.1e}" == failure
