"""The statistics of `fedmqtt report`: Holm's correction, the site bootstrap's coverage, paired tests that
see what an unpaired one misses, effect sizes, and tables that state their seeds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.stats import ranksums

from fedmqtt.experiments.paired import paired_table
from fedmqtt.experiments.runs import load_runs
from fedmqtt.experiments.stats import holm, mean_interval, paired, rank_biserial, site_seed_mean
from fedmqtt.experiments.tables import render_markdown, render_text, seeds_line, summary_table
from tests.unit.test_experiment_report import write_run


def test_holm_against_a_worked_example() -> None:
    """p = (0.01, 0.04, 0.03, 0.005), m = 4. Sorted: 0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06;
    0.04 x 1 = 0.04, raised to the running maximum 0.06. Back in input order: 0.03, 0.06, 0.06, 0.02."""
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([None, 0.02, 0.5]) == [None, pytest.approx(0.04), pytest.approx(0.5)]  # m = 2
    assert holm([0.6, 0.7]) == [1.0, 1.0]  # capped at 1
    assert holm([]) == []


def test_site_bootstrap_interval_covers_the_true_mean_most_of_the_time() -> None:
    """200 seeded simulations of 15 sites x 3 seeds (site effects sd 0.05, seed noise sd 0.01): the 95 %
    interval holds the true mean in at least 85 % of them (percentile intervals run a little short)."""
    rng = np.random.default_rng(11)
    truth, hits = 0.7, 0
    for _ in range(200):
        sites = truth + 0.05 * rng.normal(size=(15, 1))
        interval = mean_interval(sites + 0.01 * rng.normal(size=(15, 3)))
        assert interval is not None
        hits += interval[0] <= truth <= interval[1]
    assert 0.85 <= hits / 200 <= 1.0


def test_interval_and_mean_with_undefined_values() -> None:
    nan = np.nan
    matrix = np.array([[0.6, nan], [0.8, 0.7], [nan, nan]])  # the last site never has a value
    assert site_seed_mean(matrix) == pytest.approx((0.7 + 0.7) / 2)
    interval = mean_interval(matrix)
    assert interval is not None and 0.6 <= interval[0] <= interval[1] <= 0.8
    assert mean_interval(np.array([[0.5, 0.6]])) is None  # one site: nothing to resample


def test_paired_test_sees_a_consistent_small_difference_the_unpaired_one_misses() -> None:
    """Sites differ a lot (0.55 to 0.95), method a is 0.01 better at every (site, seed): the signed-rank
    test on the pairs finds it, a rank-sum test of the pooled values does not."""
    rng = np.random.default_rng(5)
    site_level = np.linspace(0.55, 0.95, 8)[:, None]
    b = site_level + 0.02 * rng.normal(size=(8, 3))
    a = b + 0.01 + 0.002 * rng.normal(size=(8, 3))
    result = paired(a, b)
    assert result.n == 24 and result.p is not None and result.p < 1e-4
    assert float(ranksums(a.ravel(), b.ravel()).pvalue) > 0.5
    assert result.rank_biserial == 1.0 and result.median == pytest.approx(0.01, abs=0.002)
    assert result.interval is not None and 0 < result.interval[0] < result.median < result.interval[1]


def test_rank_biserial_and_identical_methods() -> None:
    assert rank_biserial(np.array([1.0, -1.0, 2.0, -2.0])) == 0.0
    assert rank_biserial(np.array([-0.1, -0.2, 0.0])) == -1.0  # the zero is dropped
    same = paired(np.ones((3, 2)), np.ones((3, 2)))
    assert (same.n, same.p, same.median, same.rank_biserial) == (6, 1.0, 0.0, None)
    assert paired(np.full((2, 2), np.nan), np.ones((2, 2))).p is None


def test_tables_state_their_seeds_and_a_single_seed_says_what_it_lacks(tmp_path: Path) -> None:
    values = {"a": 0.8, "b": 0.7, "c": 0.75}
    runs = [write_run(tmp_path / "three", alg, seed, values) for alg in ("fedavg", "fedprox") for seed in (0, 1, 2)]
    (table,) = summary_table(load_runs(runs), "auroc")
    (tests,) = paired_table(load_runs(runs), "auroc")
    assert seeds_line(table) == "seeds: 0, 1, 2; intervals resample sites, not seeds"
    md = render_markdown([table], [tests])
    assert "seeds: 0, 1, 2" in md and "mean 95% CI" in md and "Holm p" in md
    one = [write_run(tmp_path / "one", alg, 4, values) for alg in ("fedavg", "fedprox")]
    (single,) = summary_table(load_runs(one), "auroc")
    text = render_text([single], paired_table(load_runs(one), "auroc"))
    assert "one seed (4): no confidence interval across seeds; intervals resample sites only" in text
    uneven = runs[:5]  # fedprox lacks seed 2
    (partial,) = summary_table(load_runs(uneven), "auroc")
    assert seeds_line(partial) == "seeds: 0, 1, 2 (fedprox: 0, 1); intervals resample sites, not seeds"


def test_holm_runs_over_every_comparison_of_a_table(tmp_path: Path) -> None:
    """Three methods, three comparisons: each Holm p is at least its raw p, and the smallest is tripled."""
    rng = np.random.default_rng(8)
    sites = [f"s{i}" for i in range(6)]
    for seed in range(3):
        base = {s: 0.6 + 0.05 * i + 0.01 * rng.normal() for i, s in enumerate(sites)}
        for alg, shift in (("fedavg", 0.0), ("fedprox", 0.02), ("scaffold", 0.021)):
            write_run(tmp_path, alg, seed, {s: v + shift + 0.001 * rng.normal() for s, v in base.items()})
    (table,) = paired_table(load_runs([tmp_path]), "auroc")
    pairs = [(c.result.p, c.p_holm) for c in table.comparisons if c.result.p is not None and c.p_holm is not None]
    assert len(pairs) == 3 and all(adjusted >= p for p, adjusted in pairs)
    p, adjusted = min(pairs)
    assert adjusted == pytest.approx(min(1.0, 3 * p))


def test_reference_rows_come_from_the_reports_and_are_neither_best_nor_compared(tmp_path: Path) -> None:
    """A simulated report's baselines become rows in parentheses: the constant optimal for the table's metric,
    the pooled reference; never marked best (even when better) and not in the paired comparisons."""
    import json

    runs = []
    for seed in (0, 1):
        for alg, shift in (("fedavg", 0.0), ("fedprox", 0.05)):
            run = write_run(tmp_path, alg, seed, {"a": 0.6 + shift, "b": 0.5 + shift}, metric="loss")
            report = json.loads((run / "report.json").read_text())

            def per_site(loss: float) -> dict[str, object]:
                return {s: {"metrics": {"val": {"loss": loss}, "test": {"loss": loss}}} for s in ("a", "b")}
            constant = {"metrics": ["loss", "accuracy"], "name": "log-loss and accuracy", "per_site": per_site(0.69)}
            report["baselines"] = {
                "constants": [constant],
                "pooled_reference": {"fitted": True, "what": "logistic regression", "per_site": per_site(0.3)},
                "site_alone": {"what": "own constant", "per_site": per_site(0.65)}}
            (run / "report.json").write_text(json.dumps(report))
            runs.append(run)
    (table,) = summary_table(load_runs(runs), "loss")
    labels = [row.algorithm for row in table.rows]
    assert labels == ["fedavg", "fedprox", "best constant", "pooled reference", "site alone"]
    pooled = table.rows[3]
    assert pooled.reference and pooled.cells["a"].mean == pytest.approx(0.3) and not pooled.cells["a"].best
    assert table.rows[0].cells["a"].best  # the best method, though the reference is lower
    (tests,) = paired_table(load_runs(runs), "loss")
    assert tests.names == ("fedavg", "fedprox")
    text = render_text([table], [tests])
    assert "(pooled reference)" in text and "rows in parentheses are references" in text
    (auroc,) = summary_table(load_runs(runs), "auroc")  # no run has AUROC: no reference row either
    assert all(not row.reference for row in auroc.rows)


def _three_algorithms_two_norms(root: Path) -> list[Path]:
    """fedavg, fedprox, fedpxn (in that table order) with BN and GN, 5 sites x 3 seeds; fedpxn/bn is
    0.02 better than everything at every pair, the others differ by noise only."""
    rng = np.random.default_rng(3)
    sites = [f"s{i}" for i in range(5)]
    runs = []
    for seed in range(3):
        level = {s: 0.6 + 0.05 * i for i, s in enumerate(sites)}
        for alg in ("fedavg", "fedprox", "fedpxn"):
            for norm in ("bn", "gn"):
                shift = 0.02 if (alg, norm) == ("fedpxn", "bn") else 0.0
                values = {s: v + shift + 0.003 * rng.normal() for s, v in level.items()}
                runs.append(write_run(root, alg, seed, values, norm=norm))
    return runs


def test_versus_compares_one_method_against_every_other_with_holm_over_those(tmp_path: Path) -> None:
    """--versus fedpxn/bn: five comparisons (not fifteen), fedpxn/bn always on the a side though it comes
    last in the table, p = scipy's signed-rank p of its (site, seed) differences, Holm over the five."""
    from scipy.stats import wilcoxon

    records = load_runs(_three_algorithms_two_norms(tmp_path))
    (table,) = paired_table(records, "auroc", versus="fedpxn/bn")
    assert [(c.a, c.b) for c in table.comparisons] == [("fedpxn/bn", other) for other in
                                                      ("fedavg/bn", "fedavg/gn", "fedprox/bn", "fedprox/gn",
                                                       "fedpxn/gn")]
    assert table.family == "fedpxn/bn against every other method"
    by_label = {(r.algorithm + "/" + r.norm, r.seed): r for r in records}
    first = table.comparisons[0]
    diffs = [by_label[("fedpxn/bn", seed)].value("final", s, "auroc")
             - by_label[("fedavg/bn", seed)].value("final", s, "auroc")  # type: ignore[operator]
             for seed in range(3) for s in by_label[("fedavg/bn", seed)].sites]
    assert first.result.n == 15 and first.result.p == pytest.approx(float(wilcoxon(diffs).pvalue))
    assert first.result.median is not None and first.result.median > 0.01 and first.result.rank_biserial == 1.0
    smallest = min(table.comparisons, key=lambda c: c.result.p or 1.0)
    assert smallest.p_holm == pytest.approx(min(1.0, 5 * (smallest.result.p or 1.0)))
    assert all(c.p_holm is not None and c.p_holm < 0.05 for c in table.comparisons)
    # Every pair: fifteen comparisons, so the same p-values are multiplied by up to fifteen.
    (every,) = paired_table(records, "auroc")
    assert len(every.comparisons) == 15 and every.family == "every pair of methods"


def test_versus_an_algorithm_stands_for_each_of_its_norms_and_norm_pairs_stay_within_one(tmp_path: Path) -> None:
    records = load_runs(_three_algorithms_two_norms(tmp_path))
    (versus,) = paired_table(records, "auroc", versus="fedpxn")
    assert len(versus.comparisons) == 8  # fedpxn/bn and fedpxn/gn against the four others
    assert all(c.a.startswith("fedpxn/") and not c.b.startswith("fedpxn/") for c in versus.comparisons)
    (norms,) = paired_table(records, "auroc", norm_pairs=True)
    assert [(c.a, c.b) for c in norms.comparisons] == [("fedavg/bn", "fedavg/gn"), ("fedprox/bn", "fedprox/gn"),
                                                       ("fedpxn/bn", "fedpxn/gn")]
    (both,) = paired_table(records, "auroc", versus="fedpxn", norm_pairs=True)
    assert len(both.comparisons) == 8 + 3
    assert "fedpxn against every other method and the norms" in both.family
    text = render_text(summary_table(records, "auroc"), [both])
    assert "paired comparisons: fedpxn against every other method and the norms of each algorithm against each " \
           "other, Holm over 11" in text


def test_versus_an_unknown_method_names_the_known_ones(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fedmqtt.cli import app
    from fedmqtt.errors import ConfigError

    _three_algorithms_two_norms(tmp_path)
    with pytest.raises(ConfigError, match="fedpxn/bn"):
        paired_table(load_runs([tmp_path]), "auroc", versus="fedpnx")
    result = CliRunner().invoke(app, ["report", str(tmp_path), "--metric", "auroc", "--versus", "fedpnx"])
    assert result.exit_code == 2 and "no such method" in result.output
    ok = CliRunner().invoke(app, ["report", str(tmp_path), "--metric", "auroc", "--versus", "fedpxn/bn"])
    assert ok.exit_code == 0 and "fedpxn/bn - fedavg/gn" in ok.output and "fedavg/bn - fedprox/bn" not in ok.output
