"""SecAgg+'s neighbourhood graph (fedmqtt/secagg/graph.py): its parameters grow like log n, it is symmetric and
regular, every party computes the same one, and nobody can pick it."""

from __future__ import annotations

import math

import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.graph import build, choose

CTX = RoundContext("graph-run", 4)


def test_degree_grows_like_log_n_and_threshold_is_a_majority() -> None:
    degrees = {n: choose(n, 0.1).degree for n in (100, 1000, 10_000, 100_000)}
    assert degrees[100] < degrees[1000] < degrees[10_000] < degrees[100_000] <= 60
    # a tenfold increase in n adds a near-constant number of neighbours (log growth)
    steps = [degrees[10 * n] - degrees[n] for n in (100, 1000, 10_000)]
    assert max(steps) <= 2 * min(steps) + 2
    for n in (5, 50, 500):
        params = choose(n, 0.1)
        assert params.threshold == params.degree // 2 + 1
        assert 2 * params.threshold > params.degree


def test_failure_probability_meets_the_target_when_the_graph_is_sparse() -> None:
    params = choose(1000, 0.1)
    assert not params.complete and params.failure_probability <= 2.0 ** -20
    keep = 0.9  # recompute the union bound independently
    fewer = sum(math.comb(params.degree, r) * keep**r * (1 - keep) ** (params.degree - r)
                for r in range(params.threshold))
    assert params.failure_probability == pytest.approx(1000 * fewer)
    small = choose(10, 0.1)
    assert small.complete and small.degree == 9 and small.failure_probability > 2.0 ** -20  # reported, not hidden


@pytest.mark.parametrize("n", [3, 4, 10, 37, 200])
def test_graph_is_symmetric_regular_and_the_same_for_everyone(n: int) -> None:
    sites = [f"site-{i}" for i in range(n)]
    graph = build(CTX, sites, 0.1)
    again = build(CTX, list(reversed(sites)), 0.1)
    assert graph == again
    for site, near in graph.neighbours.items():
        assert site not in near and len(near) == graph.params.degree and list(near) == sorted(near)
        for other in near:
            assert graph.are_neighbours(other, site)
            assert 1 <= graph.share_index(site, other) <= graph.params.degree


def test_graph_changes_with_the_round() -> None:
    sites = [f"site-{i}" for i in range(200)]
    assert build(CTX, sites, 0.1).neighbours != build(RoundContext("graph-run", 5), sites, 0.1).neighbours


def test_too_few_sites_or_too_much_dropout_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 3"):
        choose(2, 0.1)
    with pytest.raises(ConfigError, match="dropout"):
        choose(10, 0.5)
