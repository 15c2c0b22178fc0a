"""Before round 1: would enough sites accept this run under their privacy policies?

Every site publishes its policy in its status (schemas.messages.SiteStatus.privacy_policy, signed like every
payload). The PS checks its own configuration against each online site's policy, rule by rule, the way the
site will judge every task (site_agent.policy.task_refusal), and does not start a run that fewer than `quorum`
sites would accept: no round of it could close. Pure functions: the machine calls them while it waits for sites.

What the PS cannot judge ahead is left to the site, round by round: the epsilon its ledger has spent already
(a run whose own target epsilon is within the site's max_epsilon can still be refused once the ledger's earlier
spending is added), and the epsilon of a run given by its noise multiplier (that needs the accountant, which
runs at the site).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ps_daemon.config import DaemonConfig
from schemas.base import MAX_DETAIL
from schemas.messages import PrivacyPolicy

MAX_REFUSERS_NAMED = 8  # sites named with their rules in one status line (it reaches every site)
MAX_NAMES_LISTED = 8  # a policy may list hundreds of algorithms or models


def run_breaches(config: DaemonConfig, policy: PrivacyPolicy, n_train: int) -> tuple[str, ...]:
    """Each rule of `policy` that this run breaks, as "rule: why"; () when the site would accept every task.

    `n_train`: the training records the site reported in its status (what min_records_per_update is judged on).
    """
    dp = config.record_dp()
    out: list[str] = []
    if policy.algorithms is not None and config.algorithm not in policy.algorithms:
        out.append(f"algorithms: the run's {config.algorithm!r} is not listed ({_listed(policy.algorithms)})")
    if policy.models is not None and config.model.name not in policy.models:
        out.append(f"models: the run's {config.model.name!r} is not listed ({_listed(policy.models)})")
    if policy.max_rounds is not None and config.rounds > policy.max_rounds:
        out.append(f"max_rounds {policy.max_rounds}: the run has {config.rounds} rounds")
    if policy.max_epochs is not None and config.train.epochs > policy.max_epochs:
        out.append(f"max_epochs {policy.max_epochs}: the run trains {config.train.epochs} local epochs per round")
    if n_train < policy.min_records_per_update:
        out.append(f"min_records_per_update {policy.min_records_per_update}: the site has {n_train} training "
                   "records")
    if policy.require_secure_aggregation and not config.secure_aggregation.enabled:
        out.append("require_secure_aggregation: the run sends updates in the clear (secure_aggregation is off)")
    if dp is None:
        if policy.require_record_dp:
            out.append("require_record_dp: the run has no record-level DP (train.dp)")
        if policy.max_epsilon is not None:
            out.append(f"max_epsilon {policy.max_epsilon:g}: the run has no record-level DP (train.dp), so its "
                       "epsilon is unbounded")
        return tuple(out)
    if policy.max_delta is not None and dp.delta > policy.max_delta:
        out.append(f"max_delta {policy.max_delta:g}: the run's delta is {dp.delta:g}")
    if policy.max_epsilon is not None and dp.target_epsilon is not None and dp.target_epsilon > policy.max_epsilon:
        out.append(f"max_epsilon {policy.max_epsilon:g}: the run plans to spend epsilon {dp.target_epsilon:g}")
    return tuple(out)


def refusing_sites(config: DaemonConfig, policies: Mapping[str, PrivacyPolicy | None], n_train: Mapping[str, int],
                   candidates: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The candidates whose published policy this run breaks, each with the rules. A site that published no
    policy (one that predates it) is taken to accept: it enforces none."""
    out = {}
    for site in candidates:
        policy = policies.get(site)
        if policy is not None and (broken := run_breaches(config, policy, n_train.get(site, 0))):
            out[site] = broken
    return out


def describe(refusers: Mapping[str, tuple[str, ...]]) -> str:
    """"site (rule: why; rule: why), ..." for at most MAX_REFUSERS_NAMED sites, then how many more."""
    named = [f"{site} ({'; '.join(rules)})" for site, rules in sorted(refusers.items())[:MAX_REFUSERS_NAMED]]
    more = len(refusers) - len(named)
    return ", ".join(named) + (f" and {more} more" if more > 0 else "")


def quorum_refusal(config: DaemonConfig, refusers: Mapping[str, tuple[str, ...]], candidates: Iterable[str]
                   ) -> str | None:
    """Why the run cannot start: fewer than `quorum` candidates would accept it (None: enough would)."""
    pool = list(candidates)
    accepting = [s for s in pool if s not in refusers]
    if len(accepting) >= config.quorum:
        return None
    why = (f"the privacy policies of {len(refusers)} of {len(pool)} online site(s) refuse this run, leaving "
            f"{len(accepting)}, fewer than quorum {config.quorum}: no round could close. Change the run's config, or "
           f"those sites' [privacy] policies and restart them. Refusing: {describe(refusers)}")
    return why if len(why) <= MAX_DETAIL else why[: MAX_DETAIL - 3] + "..."


def _listed(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:MAX_NAMES_LISTED]) or "none"
    return shown + (f" and {len(names) - MAX_NAMES_LISTED} more" if len(names) > MAX_NAMES_LISTED else "")
