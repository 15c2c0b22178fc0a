"""Recruitment (docs/algorithms.md 15 worked example) and per-round sampling (0.4)."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.recruitment import los_histogram, recruit, sample_sites

HIST = {
    "a": [30, 30, 20, 10, 5, 5, 0, 0, 0, 0],
    "b": [40, 40, 30, 20, 20, 10, 10, 10, 10, 10],
    "c": [0, 0, 0, 0, 0, 0, 0, 0, 5, 20],
    "d": [16, 16, 16, 16, 0, 0, 0, 0, 0, 0],
}
SIZES = {"a": 100, "b": 200, "c": 25, "d": 64}


def test_worked_example_scores_and_ranking() -> None:
    """div_c and nu_c match the printed digits; ranking B, A, D, C; nu_g = 1.7089093236."""
    r = recruit(HIST, SIZES, gamma_dv=0.5, gamma_sa=0.5, gamma_th=0.2)
    by_site = {c.site_id: c for c in r.ranking}
    assert by_site["a"].divergence == pytest.approx(0.3992287918, abs=1e-10)
    assert by_site["b"].score == pytest.approx(0.1425532825, abs=1e-10)
    assert by_site["c"].score == pytest.approx(0.9843187661, abs=1e-10)
    assert by_site["d"].score == pytest.approx(0.3324228792, abs=1e-10)
    assert [c.site_id for c in r.ranking] == ["b", "a", "d", "c"]
    assert r.total == pytest.approx(1.7089093236, abs=1e-10)
    assert r.threshold == pytest.approx(0.3417818647, abs=1e-10)


@pytest.mark.parametrize(("gamma_th", "recruited"), [
    (0.2, ("b", "a")), (0.3, ("b", "a", "d")), (0.5, ("b", "a", "d", "c")), (0.0, ("b",)), (1.0, ("b", "a", "d", "c")),
])
def test_worked_example_thresholds(gamma_th: float, recruited: tuple[str, ...]) -> None:
    """Each gamma_th of the worked example recruits the printed set (inclusive crossing)."""
    assert recruit(HIST, SIZES, gamma_th=gamma_th).recruited == recruited


def test_ties_break_by_site_id_and_unrankable_sites_are_named() -> None:
    """Equal scores rank by ascending site id; a site without a histogram is not rankable, with a reason."""
    r = recruit({"z": [5, 5], "y": [5, 5], "x": None}, {"z": 10, "y": 10, "x": 10}, gamma_th=1.0)
    assert [c.site_id for c in r.ranking] == ["y", "z"]
    assert r.unrankable == ("x",)
    assert "cannot be ranked" in r.explain("x")
    assert r.explain("y").startswith("recruited: score") and "rank 1 of 2" in r.explain("y")


def test_los_bins_follow_the_code() -> None:
    """0.0 and 0.99 -> b0; 1.0 -> b1; 7.99 -> b7; 8.0 and 13.99 -> b8; 14.0 and 30 -> b9."""
    hist = los_histogram(np.array([0.0, 0.99, 1.0, 7.99, 8.0, 13.99, 14.0, 30.0]))
    assert hist == [2, 1, 0, 0, 0, 0, 0, 1, 2, 2]


def test_sampling_is_seeded_by_run_and_round() -> None:
    """Scheltjens et al.: 10 % of 189 gives 19 and of 54 gives 5; the draw repeats for the same (seed, round)."""
    pool = [f"s{i:03d}" for i in range(189)]
    assert len(sample_sites(pool, 0.1, seed=0, round_no=1)) == 19
    assert len(sample_sites(pool[:54], 0.1, seed=0, round_no=1)) == 5
    assert len(sample_sites(pool[:6], 2 / 6, seed=0, round_no=1)) == 2
    assert sample_sites(pool, 0.1, seed=7, round_no=3) == sample_sites(list(reversed(pool)), 0.1, seed=7, round_no=3)
    assert sample_sites(pool, 0.1, seed=7, round_no=3) != sample_sites(pool, 0.1, seed=7, round_no=4)
    assert sample_sites(pool, None, seed=0, round_no=1) == tuple(sorted(pool))
