"""SecAgg+'s sparse graph (Bell et al., "Secure single-server aggregation with (poly)logarithmic overhead", 2020):
each site exchanges masks and secret shares with k neighbours instead of every other site.

Parameters, from the number of sites m that advertised keys and a target dropout fraction delta (`choose`):
- t = floor(k / 2) + 1, a strict majority of a neighbourhood: the PS must collect t shares to rebuild a secret,
  and an honest site gives the PS either the self-mask share or the mask-key share of a neighbour, never both, so
  two disjoint sets of answers large enough to unmask one site's update cannot exist (2t > k);
- k is the smallest even degree for which, with every site dropping independently with probability delta, the
  union bound over the m neighbourhoods puts the chance that any of them keeps fewer than t sites at or below
  2^-failure_bits. That probability falls exponentially in k, so k grows like log m;
- where no such k below m - 1 exists (small federations) the graph is complete (plain SecAgg, k = m - 1) and the
  achieved failure probability is reported instead.
Up to t - 1 colluding sites in a neighbourhood (and a semi-honest PS) learn nothing about a neighbour's update.

The graph itself is a Harary graph H(k, m) over the sites in a pseudo-random order: site p's neighbours are the
k / 2 sites on either side of it on a ring. The order is public and derived from the run, the round and the set of
sites (SHA-256), so every party computes the same graph and nobody picks it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

from fedmqtt.errors import ConfigError
from fedmqtt.secagg.context import RoundContext

DEFAULT_FAILURE_BITS = 20
GRAPH_ORDER = "graph-order"


@dataclass(frozen=True)
class GraphParams:
    """Degree k and threshold t of one round's graph, with the failure probability they achieve."""

    sites: int
    degree: int
    threshold: int
    dropout: float
    failure_probability: float  # union bound: some neighbourhood keeps fewer than t sites

    @property
    def complete(self) -> bool:
        return self.degree == self.sites - 1

    @property
    def tolerated_colluders(self) -> int:
        """Colluding sites a neighbourhood may hold without revealing a neighbour's secrets."""
        return self.threshold - 1


def _fewer_than(k: int, t: int, keep: float) -> float:
    """P[Binomial(k, keep) < t]."""
    return math.fsum(math.comb(k, r) * keep**r * (1 - keep) ** (k - r) for r in range(t))


def threshold_of(degree: int) -> int:
    return degree // 2 + 1


def choose(sites: int, dropout: float, *, failure_bits: int = DEFAULT_FAILURE_BITS) -> GraphParams:
    """Degree and threshold for `sites` sites of which a fraction `dropout` may be lost (see the module text)."""
    if sites < 3:
        raise ConfigError(f"secure aggregation needs at least 3 sites (got {sites}): with two, each learns the "
                          "other's update from the sum")
    if not 0 <= dropout < 0.5:
        raise ConfigError(f"secure aggregation: the dropout fraction must be in [0, 0.5), not {dropout}")
    keep = 1.0 - dropout
    target = 2.0 ** -failure_bits
    for degree in range(2, sites - 1, 2):
        t = threshold_of(degree)
        failure = min(1.0, sites * _fewer_than(degree, t, keep))
        if failure <= target:
            return GraphParams(sites, degree, t, dropout, failure)
    degree = sites - 1
    t = threshold_of(degree)
    return GraphParams(sites, degree, t, dropout, min(1.0, sites * _fewer_than(degree, t, keep)))


def public_order(ctx: RoundContext, sites: Iterable[str]) -> list[str]:
    """The sites in the round's public pseudo-random order."""
    members = sorted(set(sites))
    seed = hashlib.sha256(ctx.bind(GRAPH_ORDER, *members)).digest()
    return sorted(members, key=lambda site: hashlib.sha256(seed + site.encode("utf-8")).digest())


@dataclass(frozen=True)
class Graph:
    """Who is whose neighbour this round; a neighbour's share index is its position in the owner's sorted list."""

    params: GraphParams
    neighbours: dict[str, tuple[str, ...]]  # site -> its neighbours, sorted by id

    def share_index(self, owner: str, holder: str) -> int:
        """The Shamir x-coordinate (from 1) of the share of `owner`'s secrets that `holder` keeps."""
        return self.neighbours[owner].index(holder) + 1

    def are_neighbours(self, a: str, b: str) -> bool:
        return b in self.neighbours.get(a, ())


def build(ctx: RoundContext, sites: Iterable[str], dropout: float, *,
          failure_bits: int = DEFAULT_FAILURE_BITS) -> Graph:
    """The graph of the sites that advertised keys this round."""
    order = public_order(ctx, sites)
    params = choose(len(order), dropout, failure_bits=failure_bits)
    m, half = len(order), params.degree // 2
    neighbours: dict[str, tuple[str, ...]] = {}
    for position, site in enumerate(order):
        if params.complete:
            near = set(order) - {site}
        else:
            near = {order[(position + step) % m] for step in range(-half, half + 1) if step != 0}
        neighbours[site] = tuple(sorted(near))
    return Graph(params, neighbours)
