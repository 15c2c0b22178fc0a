"""Before round 1, with `feature_statistics = "federated"`: which sites' feature summaries the PS still waits for,
which summaries it refuses, and the federation's statistics once every online site has sent one. Pure functions:
the machine calls them while it waits for sites (as it does ps_daemon.policy_quorum's).

A summary is held only if it can be added to the ones held already (same columns, histogram grid and fixed
columns): a site whose data differ is refused with the reason, before it can block or skew the combination.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from fedmqtt.data.feature_wire import combine_messages, mismatch
from ps_daemon.config import DaemonConfig
from ps_daemon.naming import named
from schemas.feature_stats import FeatureStatistics, FeatureSummary

# In the PS's out_dir: the federation's statistics, kept before they are published (a resumed PS sends them again)
STATISTICS_FILE = "feature_statistics.msgpack"


def statistics_path(config: DaemonConfig) -> Path:
    return Path(config.out_dir) / STATISTICS_FILE


def wanted(config: DaemonConfig) -> bool:
    return config.feature_statistics == "federated"


def already_combined(statistics: FeatureStatistics | None, site: str) -> bool:
    """Whether this site's summary is in the federation's statistics: another copy (the broker keeps summaries
    retained and replays them to a resumed PS, which holds the statistics but not the summaries) changes nothing."""
    return statistics is not None and site in statistics.sites


def summary_rejection(config: DaemonConfig, held: Mapping[str, FeatureSummary], statistics: FeatureStatistics | None,
                      site: str, summary: FeatureSummary) -> str | None:
    """Why this summary cannot be held now (None: it can). A copy of the one held (a restarted site sends its
    retained summary again) is no refusal: the caller drops it."""
    if not wanted(config):
        return "this run standardises with each site's own statistics (feature_statistics = \"site\")"
    if site not in config.sites:
        return "site not in the PS config"
    if statistics is not None:
        return "the federation's statistics are combined already"
    if site in held:
        return None if held[site] == summary else "a second, different summary (the first one is kept)"
    for other in held.values():
        if (why := mismatch(other, summary)) is not None:
            return why
    return None


def missing(held: Mapping[str, FeatureSummary], ready: Iterable[str]) -> tuple[str, ...]:
    """The online sites (of the config) whose summaries the PS still waits for."""
    return tuple(sorted(s for s in ready if s not in held))


def waiting_line(waiting: tuple[str, ...], errors: Mapping[str, str] | None = None) -> str:
    """What the PS waits for, with what each of those sites' status says is wrong (e.g. data without columns)."""
    reported = [f"{site} reports: {errors[site][:400]}" for site in waiting if errors and site in errors]
    return f"waiting for feature summaries from sites {named(waiting)}" + "".join(f"; {r}" for r in reported)


def combined(config: DaemonConfig, held: Mapping[str, FeatureSummary], ready: Iterable[str],
             session: str) -> FeatureStatistics:
    """The federation's statistics from the summaries of the online sites (every one of them held)."""
    return combine_messages([held[s] for s in sorted(ready)], run_id=config.run_id, session=session)
