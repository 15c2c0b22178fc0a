"""Who takes part: recruitment once before round 1 (Scheltjens et al.) and the per-round draw
(docs/algorithms.md 0.4)."""

from __future__ import annotations

from fedmqtt.recruitment import Recruitment, recruit, recruitment_summary, sample_sites
from ps_daemon import effects as fx
from ps_daemon.config import DaemonConfig
from ps_daemon.state import DaemonState


def pool(config: DaemonConfig, state: DaemonState) -> tuple[str, ...]:
    """The sites rounds draw from: the recruited set, or every configured site."""
    if config.selection == "recruited" and state.recruited is not None:
        return state.recruited
    return config.sorted_sites


def select(config: DaemonConfig, state: DaemonState, round_no: int) -> tuple[str, ...]:
    """This round's sites, drawn from the whole pool whether online or not: a site that is away gets
    its retained task when it comes back, and one seen going offline does not hold the round up.
    A fraction is seeded by (run seed, round), so a resumed PS draws the same sites."""
    if config.selection == "all":
        return pool(config, state)
    return sample_sites(pool(config, state), config.fraction, seed=config.seed, round_no=round_no)


def run_recruitment(config: DaemonConfig, state: DaemonState, candidates: list[str]
                    ) -> tuple[tuple[str, ...], dict[str, object], list[fx.Effect]]:
    """Rank the online candidates, recruit by gamma_th, and tell every candidate where it stands."""
    g = config.recruitment
    sizes = {s: state.enrolled.get(s, 0) for s in candidates}
    hists = {s: (list(h) if (h := state.histograms.get(s)) is not None else None) for s in candidates}
    r: Recruitment = recruit(hists, sizes, gamma_dv=g.gamma_dv, gamma_sa=g.gamma_sa, gamma_th=g.gamma_th)
    summary = recruitment_summary(r, gammas=g.model_dump())
    effects: list[fx.Effect] = [fx.Log("info", (
        f"recruitment (gamma_dv={g.gamma_dv}, gamma_sa={g.gamma_sa}, gamma_th={g.gamma_th}): recruited "
        f"{len(r.recruited)} of {len(candidates)}: {', '.join(r.recruited)}; threshold {r.threshold:.4f} of "
        f"total {r.total:.4f}"))]
    for k, cand in enumerate(r.ranking):
        effects.append(fx.Log("info", f"  rank {k + 1}: {cand.site_id} n={cand.n} div={cand.divergence:.4f} "
                                      f"score={cand.score:.4f}{' (recruited)' if cand.site_id in r.recruited else ''}"))
    for site in candidates:
        rank = r.rank_of(site)
        score = r.ranking[rank - 1].score if rank else None
        effects.append(fx.PublishRecruitment(site, site in r.recruited, score, rank, len(r.ranking), r.explain(site)))
    return r.recruited, summary, effects
