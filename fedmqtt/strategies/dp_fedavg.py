"""DP-FedAvg (McMahan et al. 2018; docs/algorithms.md section 21): participant-level differential privacy on the
server, each site's model change clipped, Gaussian noise on their sum, with adaptive clipping (Andrew et al.)."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from fedmqtt.participant_dp import best_gaussian_epsilon
from fedmqtt.secagg.skellam import SkellamPlan, skellam_epsilon
from fedmqtt.strategies.aggregate import copy_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput
from fedmqtt.strategies.params import StrategyParams
from fedmqtt.strategies.rule import ServerRule
from fedmqtt.strategies.strategy_doc import StrategyDoc


class DPFedAvgParams(StrategyParams):
    clip_norm: float = Field(default=1.0, gt=0.0, le=1e6, description="C: each site's model change is clipped to "
                             "this L2 norm (the starting value under adaptive clipping)")
    noise_multiplier: float = Field(default=1.0, ge=0.0, le=1e4, description="z: Gaussian noise of std z * C on the "
                                    "sum of clipped changes; under adaptive clipping z covers the change and the "
                                    "clipped count together")
    server_lr: float = Field(default=1.0, gt=0.0, le=1e3, description="eta_s: the server adds eta_s times the "
                             "noised mean change")
    sites_per_round: float = Field(default=0.0, ge=0.0, le=1e6, description="m: the fixed denominator of the mean; "
                                   "0: every enrolled site (the accountant never assumes sampling: q = 1)")
    target_quantile: float = Field(default=0.0, ge=0.0, lt=1.0, description="gamma: adaptive clipping moves C "
                                   "towards this quantile of the sites' change norms (Andrew et al.); 0: fixed C")
    clip_lr: float = Field(default=0.2, gt=0.0, le=10.0, description="eta_C: adaptive clipping's geometric step")
    count_stddev: float = Field(default=0.0, ge=0.0, le=1e6, description="sigma_b: std of the noise on the clipped "
                                "count; 0: max(m / 20, z) (Andrew et al. suggest m / 20)")
    delta: float = Field(default=1e-5, gt=0.0, lt=1.0, description="the delta at which the participant-level "
                         "epsilon is reported")
    noise_seed: int = Field(default=-1, ge=-1, le=2**62, description="tests only: >= 0 fixes the noise; -1 draws it "
                            "from the operating system (anyone who knows the seed can subtract the noise)")

    @model_validator(mode="after")
    def _count_noise_fits(self) -> DPFedAvgParams:
        if self.target_quantile and self.count_stddev and self.noise_multiplier and \
                2 * self.count_stddev <= self.noise_multiplier:
            raise ValueError(f"count_stddev {self.count_stddev:g} leaves no noise for the change: adaptive clipping "
                             f"needs 2 * count_stddev > noise_multiplier ({self.noise_multiplier:g})")
        return self


class DPFedAvg(ServerRule):
    """DP-FedAvg with a fixed denominator (McMahan, Ramage, Talwar, Zhang, ICLR 2018):

        Delta_i = w_i - w_t, clipped to C;  w_{t+1} = w_t + eta_s (sum_i Delta_i + N(0, (z_D C)^2 I)) / m

    on every shared float tensor (trainable ones and float buffers: both are computed from the records); integer
    buffers keep the server's value. Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021):
    C <- C exp(-eta_C (b~ - gamma)), b~ = (#{||Delta_i|| <= C} + N(0, sigma_b^2)) / m, with
    z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2) so the two releases together cost what one Gaussian of multiplier z costs.
    """

    needs_only_sums = False
    sums_note = (
        "the server clips each site's model change to C before summing, and adaptive clipping counts the sites "
        "under C: both need each site's own change; under secure aggregation use distributed_dp, where the sites "
        "clip, count and add the noise"
    )

    name = "dp-fedavg"
    summary = "DP-FedAvg: clipped site changes, Gaussian noise on the sum, adaptive clip (McMahan 2018, Andrew 2021)"
    Params = DPFedAvgParams
    params: DPFedAvgParams

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.clip = self.params.clip_norm
        self.noised_rounds = 0  # rounds whose release the accountant counts (either form)
        # Distributed DP: (Delta_1, Delta_2, variance of the sum) of every round's Skellam release, ring units
        self.skellam_releases: list[tuple[float, float, float]] = []
        # Fresh OS randomness unless a test fixes it: the run's seed is known to every site.
        self._secret = self.params.noise_seed if self.params.noise_seed >= 0 else secrets.randbits(62)

    # -- the mechanism ------------------------------------------------------------------------------
    def denominator(self, enrolled: Mapping[str, int]) -> float:
        return self.params.sites_per_round or float(max(1, len(enrolled)))

    def count_stddev(self, m: float) -> float:
        return self.params.count_stddev or max(m / 20.0, self.params.noise_multiplier)

    def change_noise_multiplier(self, m: float) -> float:
        """z_D: all of z without adaptive clipping; what the clipped count leaves of it with."""
        z = self.params.noise_multiplier
        if not self.params.target_quantile or z == 0.0:
            return z
        return float((z**-2 - (2.0 * self.count_stddev(m)) ** -2) ** -0.5)

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        if not inp.updates:
            return AggregateResult(weights=copy_weights(inp.current))  # nothing released, nothing spent
        g = self.groups(inp)
        names = g.train + g.floatbuf
        m = self.denominator(inp.enrolled)
        rng = np.random.default_rng([self._secret, inp.round_no])
        clip = self.clip
        total = {n: np.zeros(np.shape(inp.current[n]), np.float64) for n in names}
        unclipped = 0
        for u in inp.updates:  # sorted by site id: the sum does not depend on arrival order
            delta = {n: np.asarray(u.tensors[n], np.float64) - np.asarray(inp.current[n], np.float64) for n in names}
            norm = math.sqrt(sum(float(np.vdot(d, d)) for d in delta.values()))
            unclipped += norm <= clip
            scale = min(1.0, clip / norm) if norm > 0 else 1.0
            for n in names:
                total[n] += scale * delta[n]
        std = self.change_noise_multiplier(m) * clip
        out: dict[str, np.ndarray] = {}
        for n in names:
            ref = np.asarray(inp.current[n])
            noised = (total[n] + rng.normal(0.0, std, size=ref.shape)) / m if std > 0 else total[n] / m
            out[n] = (ref.astype(np.float64) + self.params.server_lr * noised).astype(ref.dtype)
        diagnostics = {"clip_norm": clip, "noise_std": std / m}
        if self.params.target_quantile:
            noisy = (unclipped + rng.normal(0.0, self.count_stddev(m))) / m
            self.clip = clip * math.exp(-self.params.clip_lr * (noisy - self.params.target_quantile))
            diagnostics |= {"noisy_unclipped_fraction": noisy, "next_clip_norm": self.clip}
        self.noised_rounds += 1
        eps, accountant = self.spent()
        if math.isfinite(eps):
            diagnostics |= self._spent_diagnostics(eps, accountant)
        return AggregateResult(weights=self.complete(inp, out), diagnostics=diagnostics)

    def aggregate_noised_sum(self, inp: RoundInput, change_sum: Mapping[str, np.ndarray], plan: SkellamPlan,
                             sites: int, count: float | None = None) -> AggregateResult:
        """Distributed DP under secure aggregation (ps_daemon/distributed_dp.py): `change_sum` is what the PS
        unmasked, the `sites` sites' changes (each clipped to C by its site) plus their Skellam noise, per float
        tensor; the PS divides it by the fixed m and adds nothing. The round is charged the noise its sum had.
        Adaptive clipping: `count` is the noised number of sites whose change was within C (summed under secure
        aggregation with its own noise), and C moves as in the clear form."""
        if not change_sum or sites <= 0:
            return AggregateResult(weights=copy_weights(inp.current))  # nothing released, nothing spent
        m = self.denominator(inp.enrolled)
        out: dict[str, np.ndarray] = {}
        for name, total in change_sum.items():
            ref = np.asarray(inp.current[name])
            out[name] = (ref.astype(np.float64) + self.params.server_lr * np.asarray(total) / m).astype(ref.dtype)
        self.skellam_releases.extend(plan.releases(sites))
        diagnostics = {"clip_norm": plan.clip, "noise_std": plan.sum_std(sites) / m, "sites_in_sum": float(sites),
                       "noise_calibrated_for": float(plan.expected_sites)}
        if self.params.target_quantile and count is not None:
            noisy = count / m
            self.clip = plan.clip * math.exp(-self.params.clip_lr * (noisy - self.params.target_quantile))
            diagnostics |= {"noisy_unclipped_fraction": noisy, "next_clip_norm": self.clip}
        self.noised_rounds += 1
        eps = skellam_epsilon(self.skellam_releases, self.params.delta)
        if math.isfinite(eps):
            diagnostics |= self._spent_diagnostics(eps, "skellam")
        return AggregateResult(weights=self.complete(inp, out), diagnostics=diagnostics)

    # -- the accountant -----------------------------------------------------------------------------
    def epsilon(self) -> float:
        """Participant-level epsilon after the rounds so far: each round one Gaussian release of multiplier z at
        q = 1, the smaller of Opacus' RDP and PRV epsilons (fedmqtt/participant_dp.py). Never amplified by
        sampling: the PS's selection is every site or a fixed-size draw from the run's public seed, not the
        Poisson sampling with secret randomness that amplification needs."""
        return self.spent()[0]

    def spent(self) -> tuple[float, str]:
        """`epsilon()` and the accountant whose bound it is ("rdp" or "prv")."""
        z = self.params.noise_multiplier
        if self.noised_rounds == 0:
            return 0.0, "rdp"
        if z == 0.0:
            return math.inf, "rdp"
        return best_gaussian_epsilon(z, self.noised_rounds, self.params.delta)

    def _spent_diagnostics(self, eps: float, accountant: str) -> dict[str, float]:
        """What a round's record says of the run's spending (ps_daemon/participant_spent.py reads it back):
        epsilon at delta, the releases charged so far, and `epsilon_<accountant>` naming whose bound it is."""
        return {"epsilon": eps, "delta": self.params.delta, "epsilon_rounds": float(self.noised_rounds),
                f"epsilon_{accountant}": eps}

    def state_dict(self) -> dict[str, Any]:
        return {"clip": float(self.clip), "noised_rounds": int(self.noised_rounds),
                "skellam_releases": [list(map(float, r)) for r in self.skellam_releases]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        clip = float(state.get("clip", self.params.clip_norm))
        rounds = int(state.get("noised_rounds", 0))
        if not (math.isfinite(clip) and clip > 0 and rounds >= 0):
            raise ValueError(f"{self.name}: bad server state (clip {clip}, rounds {rounds})")
        releases = state.get("skellam_releases", [])
        if not isinstance(releases, list) or not all(
                isinstance(r, list | tuple) and len(r) == 3 and all(isinstance(x, int | float) and math.isfinite(x)
                                                                  and x > 0 for x in r) for r in releases):
            raise ValueError(f"{self.name}: bad server state (skellam_releases {releases!r:.200})")
        self.clip, self.noised_rounds = clip, rounds
        self.skellam_releases = [(float(a), float(b), float(c)) for a, b, c in releases]


ABOUT = StrategyDoc(
    section="21",
    title="DP-FedAvg: participant-level differential privacy",
    names=("dp-fedavg",),
    summary=(
        "Differentially private federated averaging: the server clips each site's model change to a norm C, "
        "adds Gaussian noise to their sum and divides by a fixed number of sites, so the model released after "
        "each round says little about whether any one hospital took part, or what its whole data set was. "
        "Optional adaptive clipping moves C towards a quantile of the change norms, itself learnt from a noised "
        "count. The server is trusted with the un-noised changes (see docs/privacy.md); record-level DP at the "
        "sites (train.dp) protects single patients from the server too."
    ),
    server="""
Delta_i = w_i^t - w_t                          on every shared float tensor (TRAIN and float buffers)
Delta_i <- Delta_i * min(1, C / ||Delta_i||)   one L2 norm over all of a site's tensors
w_{t+1} = w_t + eta_s * (sum_i Delta_i + N(0, (z_D * C)^2 I)) / m
m = sites_per_round (fixed; 0: every enrolled site), never the number that answered
integer buffers: the server's value (a count would reveal a site's data size)
adaptive (gamma > 0):  b~ = (#{i: ||Delta_i|| <= C} + N(0, sigma_b^2)) / m
                       C <- C * exp(-eta_C * (b~ - gamma))
                       z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2),  sigma_b = count_stddev or max(m / 20, z)
without adaptive clipping z_D = z
nobody reported: w and C unchanged, nothing spent
accountant: one Gaussian release of multiplier z per round at q = 1 (no amplification by sampling),
            the smaller of Opacus' RDP and PRV epsilons
""",
    client="""
as FedAvg: plain local loss, local optimiser; send w_i^t (record-level DP-SGD too if train.dp is set)
""",
    state="Server: the clip norm C (adaptive) and the number of noised rounds (the accountant's steps), "
          "checkpointed with the model. Sites: none. The noise seed is never stored: a resumed server draws anew.",
    papers=("McMahan, Ramage, Talwar, Zhang: Learning differentially private recurrent language models, ICLR 2018 "
            "(arXiv 1710.06963).",
            "Andrew, Thakkar, McMahan, Ramaswamy: Differentially private learning with adaptive clipping, NeurIPS "
            "2021 (arXiv 1905.03871).",
            "Mironov, Talwar, Zhang: Renyi differential privacy of the sampled Gaussian mechanism (arXiv "
            "1908.10530), the accountant's analysis.",
            "Agarwal, Kairouz, Liu: The Skellam mechanism for differentially private federated learning, NeurIPS "
            "2021 (arXiv 2110.04995), the distributed form's noise and RDP."),
    differences=(
        "Fixed denominator m (McMahan et al.'s fixed-denominator estimator), never the number of sites that "
        "answered: the noise on the mean is exactly z_D C / m and one site's presence moves the sum by at most C. "
        "Dividing by the answering sites would make the sensitivity depend on who answered; the price is a mean "
        "biased towards zero in rounds where fewer than m sites answer.",
        "Uniform weights, never n_i / n: sample counts would reveal the sites' sizes and make one large site's "
        "influence unbounded.",
        "No amplification by sampling: the accountant charges every round at q = 1. The PS selects every site, or "
        "a fixed-size draw seeded by the run's public seed (`selection = \"fraction\"`), and amplification needs "
        "Poisson sampling with randomness the adversary does not know. Sites that drop out are not modelled: the "
        "reported epsilon is what the mechanism would cost if every selected site answered.",
        "sigma_b defaults to max(m / 20, z): Andrew et al.'s m / 20 alone leaves no noise budget for the change "
        "when m < 10 z, the usual case with a few hospitals.",
        "Under secure aggregation with `distributed_dp = \"skellam\"` (docs/privacy.md, \"Distributed DP\") the "
        "sites clip their changes and add the noise as integer Skellam shares in the ring (Agarwal, Kairouz, Liu), "
        "so the PS never sees an un-noised sum; the accountant then charges each round the Skellam RDP of the "
        "noise its sum had (fewer sites: less noise). Adaptive clipping there: each site also sends b_i - 1/2 "
        "with Skellam noise of its own in the masked vector's last slot, the PS moves C from the noised count it "
        "unmasks, and the accountant charges the change (z_D) and the count (sigma_b) releases of every round.",
    ),
    example="""
Two enrolled sites, C = 1, z = 0, m = 2: changes [3, 4] (norm 5, clipped to [0.6, 0.8]) and [0.3, 0] (kept)
give w_{t+1} - w_t = ([0.6, 0.8] + [0.3, 0]) / 2 = [0.45, 0.4]. With only the second site answering:
[0.3, 0] / 2 = [0.15, 0] (fixed denominator).
""",
)
