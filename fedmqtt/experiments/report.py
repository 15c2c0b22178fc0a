"""`fedmqtt report` put together: the seeds' tables of finished runs as printed, and the files --out writes.

Loading runs is `fedmqtt.experiments.runs`, the tables `fedmqtt.experiments.tables`, the held-out union
`fedmqtt.experiments.heldout`, the curves `fedmqtt.experiments.plots`; the command's options and messages
stay in `fedmqtt.cli.report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedmqtt.experiments.heldout import UnionTable, render_union_markdown
from fedmqtt.experiments.paired import PairedTable, paired_table
from fedmqtt.experiments.privacy import privacy_markdown
from fedmqtt.experiments.runs import RunRecord, Which
from fedmqtt.experiments.tables import SummaryTable, compact, render_markdown, render_text, summary_table

PER_SITE_FILE = "report-per-site.md"  # every site's column, when the printed tables summarise over sites


@dataclass(frozen=True)
class SeedReport:
    """The seeds' tables of one metric: `tables` with every site's column, `shown` as printed (with many
    sites, min / median / max over them), and the paired comparisons per partition."""

    tables: list[SummaryTable]
    shown: list[SummaryTable]
    tests: list[PairedTable]

    @property
    def summarised(self) -> bool:
        """Some table has too many sites to print each: every site's column goes to PER_SITE_FILE."""
        return self.shown != self.tables

    def text(self) -> str:
        return render_text(self.shown, self.tests)


def seed_report(records: Sequence[RunRecord], metric: str, *, which: Which = "final", versus: str | None = None,
                norm_pairs: bool = False) -> SeedReport:
    """The tables and paired comparisons; `versus` and `norm_pairs` choose the pairs (`paired_table`)."""
    tables = summary_table(records, metric, which=which)
    return SeedReport(tables=tables, shown=[compact(t) for t in tables],
                      tests=paired_table(records, metric, which=which, versus=versus, norm_pairs=norm_pairs))


def write_report(out: Path, records: Sequence[RunRecord], metric: str, seeds: SeedReport,
                 union: UnionTable | None = None) -> list[Path]:
    """OUT/report.md (the printed tables, the union's when given, the curves) with the PNG curves beside it,
    and OUT/PER_SITE_FILE when the printed tables summarise over sites. Returns the PNGs written."""
    from fedmqtt.experiments.plots import plot_curves

    plots = plot_curves(records, metric, out)
    text = render_markdown(seeds.shown, seeds.tests, plots=plots)
    if seeds.summarised:
        (out / PER_SITE_FILE).write_text(render_markdown(seeds.tables, seeds.tests,
                                                         title="fedmqtt experiment report: every site"))
    if union is not None:
        text += "\n" + render_union_markdown(union)
    if privacy := privacy_markdown(records):
        text += "\n" + privacy
    (out / "report.md").write_text(text)
    return plots
