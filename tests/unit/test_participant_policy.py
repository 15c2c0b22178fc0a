"""A site does not trust the participant-level DP terms the PS sends (site_agent.policy.participant_refusal): it
recomputes the run's epsilon with its own accountant and refuses too little noise or too much epsilon; under
distributed DP its own noise share never falls below what its policy demands (site_agent.distributed_dp.own_share);
the PS declares the terms with every task and names the sites that would refuse before round 1."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm
from test_machine_secagg import RUN, SITES, Sites, _answer, _machine, _start, _train_and_advertise

from fedmqtt.participant_dp import best_gaussian_epsilon, gaussian_epsilon, noise_for, skellam_run_epsilon
from fedmqtt.secagg import skellam as sk
from fedmqtt.secagg.weighted import layout_of, split
from fedmqtt.strategies.dp_fedavg import DPFedAvg
from ps_daemon import effects as fx
from ps_daemon.config import DaemonConfig
from ps_daemon.participant_terms import participant_terms
from ps_daemon.policy_quorum import run_breaches
from ps_daemon.state import DaemonState
from schemas.messages import GlobalModel, ModelSpec, ParticipantDP, PrivacyPolicy, TrainSettings, TrainTask
from schemas.secagg import DistributedDPTerms, SecAggTerms
from schemas.tensors import arrays_to_blobs
from site_agent.distributed_dp import own_share, run_epsilon, shared_floats
from site_agent.policy import REFUSED, participant_refusal
from site_agent.secagg_round import SiteRound
from site_agent.secagg_store import SecAggStore

WEIGHTS = {"fc.weight": np.zeros((2, 3), np.float32), "fc.bias": np.zeros(2, np.float32),
           "steps": np.array(0, np.int64)}


def _task(terms: ParticipantDP | None, round_no: int = 1, distributed: DistributedDPTerms | None = None,
          algorithm: str = "dp-fedavg") -> TrainTask:
    secure = None if distributed is None else SecAggTerms(ring_bits=32, fraction_bits=16, clip=4.0, max_sites=4,
                                                          dropout=0.1, distributed_dp=distributed)
    return TrainTask(run_id="r", sender="ps", round=round_no, site_id="a", model_hash="h", deadline=0.0,
                     settings=TrainSettings(algorithm=algorithm), secure_aggregation=secure, participant_dp=terms)


def _model() -> GlobalModel:
    return GlobalModel(run_id="r", sender="ps", round=1, model=ModelSpec(name="mlp"), model_hash="h",
                       tensors=arrays_to_blobs(WEIGHTS))


def _judge(policy: PrivacyPolicy, task: TrainTask) -> str | None:
    return participant_refusal(policy, task, lambda terms: run_epsilon(task, _model(), terms))


def _exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The tight epsilon of a Gaussian mechanism of sensitivity/std ratio mu at `delta` (Balle and Wang, Improving
    the Gaussian mechanism: delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu))."""
    def profile(eps: float) -> float:
        return float(norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)) - delta
    return float(brentq(profile, 0.0, 500.0))


GAUSS = ParticipantDP(mechanism="gaussian", noise_multiplier=1.0, rounds=10, delta=1e-5)


# -- the site's own accountant -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("z", "rounds"), [(1.0, 10), (5.0, 20), (20.0, 50)])
def test_the_sites_gaussian_epsilon_is_a_valid_bound_close_to_the_exact_one(z: float, rounds: int) -> None:
    """T rounds of the Gaussian mechanism at q = 1 are one Gaussian of ratio mu = sqrt(T) / z: the RDP epsilon the
    site computes must lie above the exact epsilon (a valid certificate) and not far above it."""
    ours = gaussian_epsilon(z, 1.0, rounds, 1e-5)
    exact = _exact_gaussian_epsilon(math.sqrt(rounds) / z, 1e-5)
    assert exact <= ours <= 1.25 * exact


@pytest.mark.parametrize(("z", "rounds"), [(5.0, 20), (50.0, 20), (160.0, 20)])
def test_prv_reproduces_the_exact_gaussian_epsilon(z: float, rounds: int) -> None:
    """Opacus' PRV accountant on T Gaussian releases at q = 1 against the exact epsilon of one Gaussian of
    mu = sqrt(T) / z: above it (an upper bound) by at most its error allowance (eps_error 0.01 either side)."""
    exact = _exact_gaussian_epsilon(math.sqrt(rounds) / z, 1e-5)
    prv = gaussian_epsilon(z, 1.0, rounds, 1e-5, "prv")
    assert exact - 1e-9 <= prv <= exact + 0.02
    best, how = best_gaussian_epsilon(z, rounds, 1e-5)
    assert (best, how) == (prv, "prv") and prv < gaussian_epsilon(z, 1.0, rounds, 1e-5, "rdp")


def test_epsilon_0_1_is_certified_with_prv_or_refused_with_the_fix() -> None:
    """The noise whose 20 rounds cost exactly 0.1 at delta 1e-5 (the Gaussian's exact profile) z0:
    25 % more noise is certified within 0.1 (by PRV, whose answer includes its error allowance of 0.01; RDP cannot
    reach 0.1 at this delta at any noise), 10 % less is refused, naming the noise that would do."""
    lo, hi = 1.0, 1e4
    for _ in range(100):  # bisect the exact noise for epsilon 0.1
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if _exact_gaussian_epsilon(math.sqrt(20) / mid, 1e-5) > 0.1 else (lo, mid)
    z0 = hi
    policy = PrivacyPolicy(max_participant_epsilon=0.1)
    enough = GAUSS.model_copy(update={"noise_multiplier": 1.25 * z0, "rounds": 20})
    assert gaussian_epsilon(1e4, 1.0, 20, 1e-5, "rdp") > 0.1  # RDP alone would refuse every run
    assert participant_refusal(policy, _task(enough), lambda t: run_epsilon(_task(t), _model(), t), noise_for) is None
    short = GAUSS.model_copy(update={"noise_multiplier": 0.9 * z0, "rounds": 20})
    why = participant_refusal(policy, _task(short), lambda t: run_epsilon(_task(t), _model(), t), noise_for)
    assert why is not None and "(gaussian, prv, noise multiplier" in why
    need = noise_for(0.1, 20, 1e-5)
    assert need is not None and z0 <= need <= 1.25 * z0  # PRV's answer carries its error allowance (0.01)
    assert f"20 rounds need noise_multiplier >= {need:.3g} (Gaussian) to stay within it" in why


def test_skellam_run_epsilon_is_the_composition_of_its_rounds() -> None:
    plan = sk.SkellamPlan(clip=1.0, noise_multiplier=2.0, expected_sites=4, fraction_bits=16, dim=8)
    one = sk.skellam_epsilon([(plan.l1, plan.l2, 4 * plan.site_variance)] * 3, 1e-5)
    assert skellam_run_epsilon(plan, 3, 1e-5) == pytest.approx(one)
    assert skellam_run_epsilon(plan, 6, 1e-5) > one


def test_the_site_sizes_distributed_noise_with_the_floats_it_sends_back() -> None:
    assert shared_floats(_task(GAUSS), _model()) == 8
    upload = _task(GAUSS).model_copy(update={"upload": ("fc.bias",)})
    assert shared_floats(upload, _model()) == 2


# -- the rules ---------------------------------------------------------------------------------------------------
def test_a_policy_without_participant_rules_accepts_any_run() -> None:
    assert _judge(PrivacyPolicy(), _task(None, algorithm="fedavg")) is None
    assert _judge(PrivacyPolicy(max_epsilon=1.0), _task(GAUSS)) is None  # record-level: another rule's business


def test_too_little_noise_is_refused_whatever_the_ps_claims() -> None:
    policy = PrivacyPolicy(min_participant_noise_multiplier=2.0)
    why = _judge(policy, _task(GAUSS))
    assert why is not None and why.startswith(REFUSED)
    assert "noise multiplier 1 is below this site's min_participant_noise_multiplier 2" in why
    assert _judge(policy, _task(GAUSS.model_copy(update={"noise_multiplier": 2.0}))) is None


def test_the_budget_is_judged_with_the_sites_own_accountant() -> None:
    eps = gaussian_epsilon(1.0, 1.0, 10, 1e-5)  # about 18
    why = _judge(PrivacyPolicy(max_participant_epsilon=eps * 0.99), _task(GAUSS))
    assert why is not None and f"epsilon is {eps:.3g} at delta 1e-05 over 10 rounds" in why
    assert _judge(PrivacyPolicy(max_participant_epsilon=eps * 1.01), _task(GAUSS)) is None
    shorter = GAUSS.model_copy(update={"rounds": 2})
    assert _judge(PrivacyPolicy(max_participant_epsilon=eps * 0.99), _task(shorter)) is None


def test_a_run_without_participant_dp_is_refused_by_a_participant_rule() -> None:
    why = _judge(PrivacyPolicy(max_participant_epsilon=8.0), _task(None, algorithm="fedavg"))
    assert why is not None and "without participant-level DP (algorithm 'fedavg')" in why
    assert "max_participant_epsilon 8" in why


def test_rounds_beyond_the_declared_run_and_a_larger_delta_are_refused() -> None:
    policy = PrivacyPolicy(max_participant_epsilon=100.0, max_delta=1e-4)
    assert _judge(policy, _task(GAUSS, round_no=10)) is None
    why = _judge(policy, _task(GAUSS, round_no=11))
    assert why is not None and "round 11 is beyond the 10 rounds the run declared" in why
    why = _judge(policy, _task(GAUSS.model_copy(update={"delta": 1e-3})))
    assert why is not None and "delta 0.001 is above this site's max_delta 0.0001" in why


def test_terms_that_contradict_the_secure_aggregation_terms_are_refused() -> None:
    policy = PrivacyPolicy(min_participant_noise_multiplier=0.5)
    skellam = GAUSS.model_copy(update={"mechanism": "skellam"})
    for task in (_task(skellam), _task(GAUSS, distributed=DistributedDPTerms(clip=1.0, noise_multiplier=1.0,
                                                                             expected_sites=4)),
                 _task(skellam, distributed=DistributedDPTerms(clip=1.0, noise_multiplier=0.9, expected_sites=4)),
                 _task(skellam, distributed=DistributedDPTerms(clip=1.0, noise_multiplier=1.0, expected_sites=4,
                                                               count_stddev=2.0))):
        why = _judge(policy, task)
        assert why is not None and "contradict" in why
    # adaptive clipping: z_D and sigma_b that amount to the declared z together are consistent
    z_d = (1.0 - (2.0 * 2.0) ** -2) ** -0.5
    adaptive = DistributedDPTerms(clip=1.0, noise_multiplier=z_d, expected_sites=4, count_stddev=2.0)
    assert _judge(policy, _task(skellam, distributed=adaptive)) is None


def test_under_skellam_the_site_charges_the_skellam_release_of_the_models_size() -> None:
    distributed = DistributedDPTerms(clip=1.0, noise_multiplier=1.0, expected_sites=4)
    task = _task(GAUSS.model_copy(update={"mechanism": "skellam"}), distributed=distributed)
    plan = sk.SkellamPlan(clip=1.0, noise_multiplier=1.0, expected_sites=4, fraction_bits=16, dim=8)
    eps: Any = run_epsilon(task, _model(), task.participant_dp)  # type: ignore[arg-type]
    assert eps == (pytest.approx(skellam_run_epsilon(plan, 10, 1e-5)), "rdp")
    eps = eps[0]
    assert eps > gaussian_epsilon(1.0, 1.0, 10, 1e-5)  # the Skellam term costs a little more
    why = _judge(PrivacyPolicy(max_participant_epsilon=eps * 0.99), task)
    assert why is not None and "(skellam, rdp, noise multiplier 1)" in why


# -- the site's own noise share under distributed DP -------------------------------------------------------------
def test_own_share_follows_the_ps_unless_the_policy_demands_more() -> None:
    asked = sk.SkellamPlan(clip=1.0, noise_multiplier=1.0, expected_sites=4, fraction_bits=16, dim=8)
    assert own_share(asked, None, 2) == asked  # no rule: the PS's share, as asked
    assert own_share(asked, 0.5, 4) == asked  # the PS asks for more than the floor
    raised = own_share(asked, 2.0, 4)
    assert raised.site_variance == pytest.approx(4 * asked.site_variance)  # (2 / 1)^2
    # a PS that claims 4 sites' shares with 2 in the roster: the floor holds for the 2 shares the sum can have
    thin = own_share(asked, 1.0, 2)
    assert thin.site_variance == pytest.approx((1.0 * asked.l2) ** 2 / 2)
    assert 2 * thin.site_variance >= (1.0 * asked.l2) ** 2


def test_a_site_adds_the_share_its_policy_demands_when_the_ps_asks_for_less(tmp_path: Path) -> None:
    """Through the PS state machine: the PS asks for z = 0.3; one site's policy demands z >= 1.2, so its share is
    (1.2 / 0.3)^2 = 16 times what was asked, and the sum the PS unmasks carries exactly that share."""
    hyper = {"clip_norm": 0.5, "noise_multiplier": 0.3}
    machine = _machine(DPFedAvg(hyper), algorithm="dp-fedavg", hyper=hyper,
                       secure_aggregation={"enabled": True, "stage_timeout_s": 10.0, "fraction_bits": 20,
                                           "clip": 4.0, "distributed_dp": "skellam"})
    strict = SITES[2]

    class StrictSites(Sites):
        def driver(self, site: str, state: DaemonState, task: fx.PublishTrainTask) -> SiteRound:
            assert task.secure is not None
            floats, _ = split(self.machine.shared_model(state))
            return SiteRound(SecAggStore(self.tmp / site), self.keys.identity(site), run_id=RUN,
                             session=state.session, round_no=state.round, terms=task.secure,
                             layout=layout_of(floats), min_noise_multiplier=1.2 if site == strict else None)

    sites = StrictSites(tmp_path, machine)
    state, effects = _start(machine)
    state, effects = _train_and_advertise(machine, sites, state, effects)
    for _ in range(3):
        state, effects = _answer(machine, sites, state, effects)
    assert state.round == 2 and state.history[-1].sites == SITES
    asked, raised = sites.rounds[SITES[0]].dp, sites.rounds[strict].dp
    assert asked is not None and raised is not None
    assert raised.site_variance == pytest.approx(16 * asked.site_variance)
    layout = sites.rounds[SITES[0]].layout
    integer = np.zeros(layout.length, np.int64)
    for s in SITES:
        sr = sites.rounds[s]
        integer += np.rint(sk.change_vector(sites.trained[s], layout, 0.5) * asked.scale).astype(np.int64)
        plan = raised if s == strict else asked
        integer += sk.site_noise(plan, sk.noise_key(sr.ctx, sr.session_state.secrets.cipher_private, s), layout)
    step = integer / asked.scale / 4
    at = 0
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        size = int(np.prod(shape))
        assert state.weights[name] == pytest.approx(step[at:at + size].reshape(shape).astype(np.float32)), name
        at += size


# -- the PS: declared with every task, judged before round 1 -------------------------------------------------------
def _config(**overrides: object) -> DaemonConfig:
    raw: dict[str, object] = {"run_id": "r1", "sites": ["a", "b", "c"], "rounds": 10, "model": {"name": "mlp"},
                              "credentials": "creds.toml", "algorithm": "dp-fedavg",
                              "hyper": {"noise_multiplier": 1.0, "delta": 1e-6}, **overrides}
    return DaemonConfig.model_validate(raw)


def test_the_ps_declares_the_runs_terms() -> None:
    assert participant_terms(_config()) == ParticipantDP(mechanism="gaussian", noise_multiplier=1.0, rounds=10,
                                                         delta=1e-6)
    assert participant_terms(_config(algorithm="fedavg", hyper={})) is None


def test_the_quorum_check_names_what_a_site_would_refuse() -> None:
    config = _config()
    assert run_breaches(config, PrivacyPolicy(min_participant_noise_multiplier=2.0), 100) == (
        "min_participant_noise_multiplier 2: the run's noise multiplier is 1",)
    eps = gaussian_epsilon(1.0, 1.0, 10, 1e-6)
    (broken,) = run_breaches(config, PrivacyPolicy(max_participant_epsilon=eps * 0.99), 100)
    assert broken.startswith(f"max_participant_epsilon {eps * 0.99:g}: the run's participant-level epsilon is "
                             f"{eps:.3g}")
    assert run_breaches(config, PrivacyPolicy(max_participant_epsilon=eps * 1.01), 100) == ()
    (broken,) = run_breaches(_config(algorithm="fedavg", hyper={}), PrivacyPolicy(max_participant_epsilon=8), 100)
    assert "no participant-level DP" in broken
