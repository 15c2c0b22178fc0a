"""A hospital's own privacy policy (the site config's [privacy] table), checked by the site before it trains.

The federation cannot override it: a task that breaks it is refused, and the site answers the round with the
reason (an update without tensors and with `no_step_reason`), which the PS logs, shows in ps/status ("dropped")
and writes into the round's record of its report. The epsilon rules need an accountant: the agent asks the
trainer for the round's projected record-level epsilon and `epsilon_refusal` judges it; for participant-level DP
it recomputes the run's epsilon from the task's terms (fedmqtt/participant_dp.py) and `participant_refusal`
judges it.
"""

from __future__ import annotations

from collections.abc import Callable

# The policy's schema is a wire definition (sites publish it in their status, and the PS checks its run against
# every site's before round 1: ps_daemon.policy_quorum); it is re-exported here for the site's config.
from schemas.messages import ModelSpec, ParticipantDP, PrivacyPolicy, TrainTask
from schemas.secagg import DistributedDPTerms

__all__ = ["REFUSED", "PrivacyPolicy", "epsilon_refusal", "participant_refusal", "task_refusal"]

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


def participant_refusal(policy: PrivacyPolicy, task: TrainTask,
                        run_epsilon: Callable[[ParticipantDP], tuple[float, str]],
                        noise_needed: Callable[[float, int, float], float | None] | None = None) -> str | None:
    """Why `policy` refuses the run's participant-level DP (its max_participant_epsilon and
    min_participant_noise_multiplier rules); None when it accepts it or has neither rule. `run_epsilon` is this
    site's own accountant (epsilon, and which accountant gave it), asked only when the budget rule needs it: the
    PS's terms are judged, never trusted. `noise_needed(epsilon, rounds, delta)`: the noise multiplier that would
    meet the budget, named in the refusal as the fix (None: no noise would)."""
    limit, floor = policy.max_participant_epsilon, policy.min_participant_noise_multiplier
    if limit is None and floor is None:
        return None
    rule = f"max_participant_epsilon {limit:g}" if limit is not None else f"min_participant_noise_multiplier {floor:g}"
    terms, distributed = task.participant_dp, _distributed(task)
    why: str | None = None
    if terms is None:
        why = (f"the task's models are released without participant-level DP (algorithm {task.settings.algorithm!r}); "
               f"this site's {rule} needs it")
    elif (terms.mechanism == "skellam") != (distributed is not None) or (
            distributed is not None and _effective(distributed) < terms.noise_multiplier * (1 - 1e-9)):
        why = "the task's participant-level DP terms contradict its secure aggregation terms"
    elif task.round > terms.rounds:
        why = f"round {task.round} is beyond the {terms.rounds} rounds the run declared (and this site judged)"
    elif policy.max_delta is not None and terms.delta > policy.max_delta:
        why = f"participant-level delta {terms.delta:g} is above this site's max_delta {policy.max_delta:g}"
    elif floor is not None and terms.noise_multiplier < floor:
        why = (f"participant-level noise multiplier {terms.noise_multiplier:g} is below this site's "
               f"min_participant_noise_multiplier {floor:g}")
    elif limit is not None and (found := run_epsilon(terms))[0] > limit:
        eps, how = found
        why = (f"the run's participant-level epsilon is {eps:.3g} at delta {terms.delta:g} over {terms.rounds} "
               f"rounds by this site's accountant ({terms.mechanism}, {how}, noise multiplier "
               f"{terms.noise_multiplier:g}), above this site's max_participant_epsilon {limit:g}")
        if noise_needed is not None:
            need = noise_needed(limit, terms.rounds, terms.delta)
            why += (f"; {terms.rounds} rounds need noise_multiplier >= {need:.3g} (Gaussian) to stay within it"
                    if need is not None else "; no noise reaches it at this delta")
    return None if why is None else f"{REFUSED}: {why}"


def _distributed(task: TrainTask) -> DistributedDPTerms | None:
    return None if task.secure_aggregation is None else task.secure_aggregation.distributed_dp


def _effective(dp: DistributedDPTerms) -> float:
    """The one Gaussian multiplier the sites' change and count shares amount to (fedmqtt.secagg.skellam's
    SkellamPlan.effective_multiplier, on the wire terms)."""
    if not dp.count_stddev:
        return dp.noise_multiplier
    return float((dp.noise_multiplier**-2 + (2.0 * dp.count_stddev) ** -2) ** -0.5)
