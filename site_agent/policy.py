"""A hospital's own privacy policy (the site config's [privacy] table), checked by the site before it trains.

The federation cannot override it: a task that breaks it is refused, and the site answers the round with the
reason (an update without tensors and with `no_step_reason`), which the PS logs, shows in ps/status ("dropped")
and writes into the round's record of its report. The epsilon rule needs the accountant: the agent asks the
trainer for the round's projected epsilon and `epsilon_refusal` judges it.
"""

from __future__ import annotations

# The policy's schema is a wire definition (sites publish it in their status, and the PS checks its run against
# every site's before round 1: ps_daemon.policy_quorum); it is re-exported here for the site's config.
from schemas.messages import ModelSpec, PrivacyPolicy, TrainTask

__all__ = ["REFUSED", "PrivacyPolicy", "epsilon_refusal", "task_refusal"]

REFUSED = "refused by this site's privacy policy"


def task_refusal(policy: PrivacyPolicy, task: TrainTask, model: ModelSpec, n_records: int) -> str | None:
    """Why `policy` refuses `task` (every rule but the epsilon budget); None when it accepts it."""
    s = task.settings
    why: str | None = None
    if policy.algorithms is not None and s.algorithm not in policy.algorithms:
        why = f"algorithm {s.algorithm!r} is not one this site accepts ({', '.join(policy.algorithms) or 'none'})"
    elif policy.models is not None and model.name not in policy.models:
        why = f"model {model.name!r} is not one this site accepts ({', '.join(policy.models) or 'none'})"
    elif policy.max_rounds is not None and task.round > policy.max_rounds:
        why = f"round {task.round} is beyond this site's max_rounds {policy.max_rounds}"
    elif policy.max_epochs is not None and s.epochs > policy.max_epochs:
        why = f"{s.epochs} local epochs per round, more than this site's max_epochs {policy.max_epochs}"
    elif n_records < policy.min_records_per_update:
        why = (f"an update from {n_records} training records, fewer than this site's min_records_per_update "
               f"{policy.min_records_per_update}")
    elif s.dp is None and (policy.require_record_dp or policy.max_epsilon is not None):
        rule = "require_record_dp" if policy.require_record_dp else f"max_epsilon {policy.max_epsilon:g}"
        why = f"the task trains without record-level DP (its epsilon is unbounded); this site's {rule} needs it"
    elif s.dp is not None and policy.max_delta is not None and s.dp.delta > policy.max_delta:
        why = f"delta {s.dp.delta:g} is above this site's max_delta {policy.max_delta:g}"
    elif policy.require_secure_aggregation and task.secure_aggregation is None:
        why = ("the task runs without secure aggregation (the PS would see this site's own update); this site's "
               "require_secure_aggregation needs it")
    return None if why is None else f"{REFUSED}: {why}"


def epsilon_refusal(policy: PrivacyPolicy, round_no: int, spent: float, after: float, delta: float) -> str | None:
    """Why the round is refused for its projected epsilon `after` (`spent` before it), at `delta`; None if within."""
    if policy.max_epsilon is None or after <= policy.max_epsilon:
        return None
    return (f"{REFUSED}: round {round_no} would bring epsilon to {after:.3g} at delta {delta:g} (spent so far "
            f"{spent:.3g}), above this site's max_epsilon {policy.max_epsilon:g}")
