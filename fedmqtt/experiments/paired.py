"""Paired comparisons between the methods of one partition's table: Wilcoxon signed-rank on (site, seed)
pairs, Holm-corrected across the table, with the median difference and the rank-biserial correlation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedmqtt.errors import ConfigError
from fedmqtt.experiments.runs import RunRecord, Which, algorithm_label, group_by, site_seed_matrix
from fedmqtt.experiments.stats import CONFIDENCE, Paired, holm, paired
from fedmqtt.means import direction_of

ALPHA = 0.05  # a Holm-adjusted p below this is marked "*"
EVERY_PAIR = "every pair of methods"


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    result: Paired  # differences a - b
    p_holm: float | None


@dataclass(frozen=True)
class PairedTable:
    """Every pair of methods (algorithm, "alg/norm" with several norms) of one partition."""

    metric: str
    which: Which
    partition: str
    names: tuple[str, ...]
    comparisons: tuple[Comparison, ...]
    family: str = EVERY_PAIR  # which pairs were compared (and Holm-corrected together)


def paired_table(records: Sequence[RunRecord], metric: str, *, which: Which = "final", versus: str | None = None,
                 norm_pairs: bool = False) -> list[PairedTable]:
    """Per partition, pairs of methods on the (site, seed) pairs where both have a defined test value
    (the site-average is not a pair); Holm's correction runs over the pairs the partition's table holds.

    By default every pair. `versus` (a method's label, or an algorithm name standing for each of its norms)
    keeps the pairs of that method against every other one, with it as `a`: the one-against-all family of
    Hwang et al.'s tests, whose Holm correction then counts those comparisons only. `norm_pairs` keeps the
    pairs of one algorithm under different norms (BN - GN...). With both, the union of the two families.

    Raises:
        ConfigError: `versus` names no method of the runs.
    """
    out = []
    if versus is not None and not any(versus in _names_of(r, records) for r in records):
        known = sorted({algorithm_label(records)(r) for r in records} | {r.algorithm for r in records})
        raise ConfigError(f"--versus {versus!r}: no such method; the runs have {', '.join(known)}")
    for partition, recs in group_by(records, lambda r: r.partition).items():
        groups = group_by(recs, algorithm_label(recs))
        sites = sorted({s for r in recs for s in r.sites})
        names = tuple(groups)
        pairs = _pairs(names, {n: groups[n][0].algorithm for n in names}, versus, norm_pairs)
        results = []
        for a, b in pairs:
            seeds = sorted({r.seed for r in groups[a]} | {r.seed for r in groups[b]})
            results.append(paired(site_seed_matrix(groups[a], sites, seeds, which, metric),
                                  site_seed_matrix(groups[b], sites, seeds, which, metric)))
        adjusted = holm([r.p for r in results])
        out.append(PairedTable(metric=metric, which=which, partition=partition, names=names,
                               comparisons=tuple(Comparison(a, b, r, q) for (a, b), r, q
                                                 in zip(pairs, results, adjusted, strict=True)),
                               family=_family(versus, norm_pairs)))
    return out


def _names_of(record: RunRecord, records: Sequence[RunRecord]) -> set[str]:
    """The names `versus` may give a record's method: its table label and its algorithm."""
    return {algorithm_label(records)(record), record.algorithm}


def _pairs(names: Sequence[str], algorithm: dict[str, str], versus: str | None,
           norm_pairs: bool) -> list[tuple[str, str]]:
    """The (a, b) pairs of the family, in table order; a `versus` method is always a."""
    def is_versus(name: str) -> bool:
        return versus is not None and versus in (name, algorithm[name])

    every = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    if versus is None and not norm_pairs:
        return every
    out = []
    for a, b in every:
        if is_versus(a) != is_versus(b):
            out.append((a, b) if is_versus(a) else (b, a))
        elif norm_pairs and algorithm[a] == algorithm[b]:
            out.append((a, b))
    return out


def _family(versus: str | None, norm_pairs: bool) -> str:
    parts = ([f"{versus} against every other method"] if versus is not None else []) + (
        ["the norms of each algorithm against each other"] if norm_pairs else [])
    return " and ".join(parts) or EVERY_PAIR


def paired_rows(table: PairedTable) -> list[list[str]]:
    """Header and one row per comparison: pairs, median difference [CI], rank-biserial r, p and Holm p."""
    def num(v: float | None, spec: str = ".3g") -> str:
        return "n/a" if v is None else format(v, spec)

    level = f"{CONFIDENCE:.0%}"
    rows = [["comparison (a - b)", "pairs", f"median a - b [{level} CI]", "rank-biserial r", "Wilcoxon p",
             "Holm p"]]
    for c in table.comparisons:
        r = c.result
        interval = "" if r.interval is None else f" [{r.interval[0]:+.3f}, {r.interval[1]:+.3f}]"
        median = "n/a" if r.median is None else f"{r.median:+.3f}{interval}"
        holm_p = num(c.p_holm) + ("*" if c.p_holm is not None and c.p_holm < ALPHA else "")
        rows.append([f"{c.a} - {c.b}", str(r.n), median, num(r.rank_biserial, "+.2f"), num(r.p), holm_p])
    return rows


def paired_note(metric: str) -> str:
    better = "higher" if direction_of(metric) == "max" else "lower"
    return (f"paired by (site, seed): Wilcoxon signed-rank (scipy.stats.wilcoxon, two-sided, zero differences "
            f"dropped) on a - b, Holm-corrected over every comparison of the table, * Holm p < {ALPHA}; "
            f"{better} {metric} is better; rank-biserial r = +1 when a is higher in every pair; the median "
            "difference's interval is a percentile bootstrap resampling sites. Pairs of one site in several "
            "seeds are not independent: with many seeds and few sites the p-value is optimistic.")
