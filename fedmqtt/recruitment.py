"""Client recruitment before the federation (Scheltjens et al.; docs/algorithms.md 15) and per-round sampling (0.4).

Pure functions: histograms and sizes in, ranking and recruited set out; sampling seeded by the run
seed and the round, so a resumed PS draws the same sites.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# Length-of-stay bins in days (docs/algorithms.md 15 DECISION: the code's bins, no lower bound on b0).
LOS_EDGES = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 14.0)


def los_histogram(days: np.ndarray) -> list[int]:
    """Counts over b0 = (-inf, 1), [1, 2), ..., [7, 8), [8, 14), b9 = [14, inf)."""
    bins = np.searchsorted(np.asarray(LOS_EDGES), np.asarray(days, dtype=np.float64), side="right")
    return [int(c) for c in np.bincount(bins, minlength=len(LOS_EDGES) + 1)]


@dataclass(frozen=True)
class Candidate:
    site_id: str
    n: int
    divergence: float
    score: float  # nu_c: lower is more representative


@dataclass(frozen=True)
class Recruitment:
    """The ranking (most representative first), the threshold and who was recruited."""

    ranking: tuple[Candidate, ...]
    total: float  # nu_g
    threshold: float  # iota = gamma_th * nu_g
    recruited: tuple[str, ...]
    unrankable: tuple[str, ...]  # sites that shared no histogram

    def rank_of(self, site: str) -> int | None:
        return next((k + 1 for k, c in enumerate(self.ranking) if c.site_id == site), None)

    def explain(self, site: str) -> str:
        """One line for a site's status: recruited or not, with its score and rank."""
        if site in self.unrankable:
            return "not recruited: it shares no label histogram (egress policy), so it cannot be ranked"
        rank = self.rank_of(site)
        cand = self.ranking[rank - 1] if rank else None
        if cand is None:
            return "not a candidate"
        verdict = "recruited" if site in self.recruited else "not recruited"
        return f"{verdict}: score {cand.score:.4f}, rank {rank} of {len(self.ranking)}"


def recruit(histograms: Mapping[str, Sequence[float] | None], sizes: Mapping[str, int], *,
            gamma_dv: float = 0.5, gamma_sa: float = 0.5, gamma_th: float = 0.1) -> Recruitment:
    """Rank candidates by nu_c = gamma_dv * div_c + gamma_sa / sqrt(n_c) and recruit by gamma_th.

    div_c is the L1 distance between the site's normalised histogram and the pooled one; walking
    the ranking (ties by site id), sites join until the running sum of nu reaches iota = gamma_th * nu_g
    (inclusive). gamma_th = 0 recruits one site, gamma_th = 1 all of them.
    """
    rankable = sorted(s for s, h in histograms.items() if h is not None and sizes.get(s, 0) > 0)
    unrankable = tuple(sorted(s for s in histograms if s not in rankable))
    if not rankable:
        return Recruitment((), 0.0, 0.0, (), unrankable)
    hist = {s: np.asarray(histograms[s], dtype=np.float64) for s in rankable}
    n_g = float(sum(sizes[s] for s in rankable))
    pooled = np.zeros_like(hist[rankable[0]])
    for s in rankable:  # sums in sorted order (19.1 item 17)
        pooled = pooled + hist[s]
    cands = []
    for s in rankable:
        div = float(np.abs(pooled / n_g - hist[s] / sizes[s]).sum())
        cands.append(Candidate(s, int(sizes[s]), div, gamma_dv * div + gamma_sa * sizes[s] ** -0.5))
    ranking = tuple(sorted(cands, key=lambda c: (c.score, c.site_id)))
    total = 0.0
    for c in ranking:  # summed in ranking order, so gamma_th = 1 ends on an exact equality
        total += c.score
    threshold = gamma_th * total
    recruited, running = [], 0.0
    for c in ranking:
        recruited.append(c.site_id)
        running += c.score
        if running >= threshold:
            break
    return Recruitment(ranking, total, threshold, tuple(recruited), unrankable)


def sample_sites(pool: Sequence[str], fraction: float | None, *, seed: int, round_no: int) -> tuple[str, ...]:
    """m = max(1, floor(fraction * N + 0.5)) distinct sites, uniformly, seeded by (run seed, round).

    `fraction` None or >= 1 takes the whole pool. The pool is sorted first, so the draw depends only
    on the set of candidates, the seed and the round (a resumed PS draws the same sites).
    """
    ordered = sorted(pool)
    if fraction is None or fraction >= 1.0 or not ordered:
        return tuple(ordered)
    m = max(1, math.floor(fraction * len(ordered) + 0.5))
    rng = np.random.default_rng([seed, round_no])
    picked = rng.choice(len(ordered), size=m, replace=False)
    return tuple(sorted(ordered[i] for i in picked))


def histogram_vector(hist: Mapping[str, int] | None) -> list[float] | None:
    """A site's reported histogram as a vector, bins ordered by their integer keys ("0", "1", ...)."""
    if not hist:
        return None
    keys = sorted(hist, key=lambda k: (int(k) if k.lstrip("-").isdigit() else math.inf, k))
    return [float(hist[k]) for k in keys]


def recruitment_summary(r: Recruitment, *, gammas: Mapping[str, float]) -> dict[str, object]:
    """What goes to the run manifest and report: gammas, ranking with scores, threshold, recruited."""
    return {
        "gammas": dict(gammas), "total": r.total, "threshold": r.threshold, "recruited": list(r.recruited),
        "unrankable": list(r.unrankable),
        "ranking": [{"site": c.site_id, "rank": k + 1, "n": c.n, "divergence": c.divergence, "score": c.score,
                     "recruited": c.site_id in r.recruited} for k, c in enumerate(r.ranking)],
    }


def label_histogram(task_kind: str, y: np.ndarray, n_outputs: int = 2) -> dict[str, int]:
    """What a site reports for recruitment/FedDkw: class counts; LoS bins for regression; per-label
    positives for multilabel (docs/algorithms.md 15 DECISION). Keys are bin indices as strings."""
    y = np.asarray(y)
    if task_kind == "regression":
        return {str(k): c for k, c in enumerate(los_histogram(y))}
    if task_kind == "multilabel":
        return {str(k): int(np.nansum(y[:, k] == 1)) for k in range(y.shape[1])}
    counts = np.bincount(y.astype(np.int64), minlength=max(n_outputs, 2))
    return {str(k): int(c) for k, c in enumerate(counts)}
