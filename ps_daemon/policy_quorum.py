"""Before round 1: would enough sites accept this run under their privacy policies?

Every site publishes its policy in its status (schemas.messages.SiteStatus.privacy_policy, signed like every
payload). The PS checks its own configuration against each online site's policy, rule by rule, the way the
site will judge every task (site_agent.policy.task_refusal), and does not start a run that fewer than `quorum`
sites would accept: no round of it could close. Pure functions: the machine calls them while it waits for sites.

What the PS cannot judge ahead is left to the site, round by round: the epsilon its ledger has spent already
(a run whose own target epsilon is within the site's max_epsilon can still be refused once the ledger's earlier
spending is added), and the record-level epsilon of a run given by its noise multiplier (that needs the
trainer's accountant, which runs at the site). Participant-level DP (DP-FedAvg) it judges with the accountant the
sites use (fedmqtt/participant_dp.py), on the terms its tasks will declare.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from ps_daemon.config import DaemonConfig
from ps_daemon.participant_terms import participant_terms, run_epsilon
from schemas.base import MAX_DETAIL
from schemas.messages import PrivacyPolicy

MAX_REFUSERS_NAMED = 8  # sites named with their rules in one status line (it reaches every site)
MAX_NAMES_LISTED = 8  # a policy may list hundreds of algorithms or models


def run_breaches(config: DaemonConfig, policy: PrivacyPolicy, n_train: int,
                 weights: Mapping[str, np.ndarray] | None = None) -> tuple[str, ...]:
    """Each rule of `policy` that this run breaks, as "rule: why"; () when the site would accept every task.

    `n_train`: the training records the site reported in its status (what min_records_per_update is judged on);
    `weights`: the tensors the sites send back (their float coordinates size distributed DP's noise).
    """
    dp = config.record_dp()
    out: list[str] = list(participant_breaches(config, policy, weights or {}))
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


def participant_breaches(config: DaemonConfig, policy: PrivacyPolicy, weights: Mapping[str, np.ndarray]
                         ) -> tuple[str, ...]:
    """The participant-level rules of `policy` this run breaks, judged as the site will judge its tasks
    (site_agent.policy.participant_refusal), by the same accountant."""
    limit, floor = policy.max_participant_epsilon, policy.min_participant_noise_multiplier
    if limit is None and floor is None:
        return ()
    terms = participant_terms(config)
    if terms is None:
        rule = f"max_participant_epsilon {limit:g}" if limit is not None else \
            f"min_participant_noise_multiplier {floor:g}"
        return (f"{rule}: the run has no participant-level DP (algorithm {config.algorithm!r}, not dp-fedavg)",)
    out: list[str] = []
    if policy.max_delta is not None and terms.delta > policy.max_delta:
        out.append(f"max_delta {policy.max_delta:g}: the run's participant-level delta is {terms.delta:g}")
    if floor is not None and terms.noise_multiplier < floor:
        out.append(f"min_participant_noise_multiplier {floor:g}: the run's noise multiplier is "
                   f"{terms.noise_multiplier:g}")
    elif limit is not None and (eps := run_epsilon(config, terms, weights)) > limit:
        out.append(f"max_participant_epsilon {limit:g}: the run's participant-level epsilon is {eps:.3g} at delta "
                   f"{terms.delta:g} over {terms.rounds} rounds")
    return tuple(out)


def refusing_sites(config: DaemonConfig, policies: Mapping[str, PrivacyPolicy | None], n_train: Mapping[str, int],
                   candidates: Iterable[str], weights: Mapping[str, np.ndarray] | None = None
                   ) -> dict[str, tuple[str, ...]]:
    """The candidates whose published policy this run breaks, each with the rules. A site that published no
    policy (one that predates it) is taken to accept: it enforces none. `weights`: as in `run_breaches`."""
    out = {}
    for site in candidates:
        policy = policies.get(site)
        if policy is not None and (broken := run_breaches(config, policy, n_train.get(site, 0), weights)):
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
