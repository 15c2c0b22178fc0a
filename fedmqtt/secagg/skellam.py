"""Distributed differential privacy under secure aggregation: the Skellam mechanism (Agarwal, Kairouz and Liu,
The Skellam mechanism for differentially private federated learning, NeurIPS 2021).

Each site clips its model change to L2 norm C, encodes it into the ring as secure aggregation does (scale
gamma = 2^fraction_bits, rounding to the nearest integer) and adds, in the ring, integer noise drawn from the
symmetric Skellam distribution Sk(v): Poisson(v / 2) - Poisson(v / 2), mean 0, variance v per coordinate. A sum of
independent Skellam variables is a Skellam variable whose variance is the sum of theirs, so the sum the PS unmasks
is the sum of the sites' encoded changes plus Sk(k v_site) noise, k the sites in the sum: no party ever sees an
un-noised sum, and no site's own noise suffices to hide its change (each adds only its share).

Sensitivity (integer units of the ring): the encoded change x of one site is the rounding of gamma times a vector
of L2 norm at most C, and rounding moves each of the d coordinates by at most 1/2, so
    ||x||_2 <= Delta_2 = gamma C + sqrt(d) / 2,      ||x||_1 <= Delta_1 = sqrt(d) Delta_2.
The guarantee is for one site's contribution: the released sum with its encoded change against the sum without it
(its change replaced by nothing), every other input the same.

RDP of one release (Agarwal, Kairouz, Liu, the Skellam mechanism's RDP, for integer orders alpha > 1 and variance v):
    eps(alpha) <= alpha Delta_2^2 / (2 v) + min(((2 alpha - 1) Delta_2^2 + 6 Delta_1) / (4 v^2), 3 Delta_1 / (2 v))
The first term is the Gaussian mechanism's RDP at the same variance, the second vanishes as v grows: Skellam costs
a little more than a Gaussian of the same variance and converges to it (tests/unit/test_distributed_dp.py checks this
against Opacus' Gaussian RDP). Rounds compose by adding RDP at every order; the conversion to (epsilon, delta) is
Opacus' (`get_privacy_spent`, the conversion of Balle et al.).

Calibration and drop-outs: the noise is set so that the sum of `expected_sites` sites carries variance
(z Delta_2)^2, a Gaussian of multiplier z; each site adds v_site = (z Delta_2)^2 / expected_sites. When fewer
sites are in the sum, it carries less noise (k v_site) and the round costs more: the accountant charges each round
the variance its sum actually had, from the number of sites the PS summed. Sites that collude with the PS know their
own noise: against them the guarantee is that of the other sites' noise alone.

Randomness: each site's noise comes from a 256-bit key derived (HKDF-SHA256) from its round's share-encryption
private key, which is fresh operating-system randomness, stays on the site and is never shared or revealed (the
PS rebuilds self-mask and mask seeds, never that key): never the run's seed, and the same noise again after a
restart (so a resumed site sends the same masked input). numpy's Poisson sampler is not hardened against
floating-point side channels (as Opacus without secure_mode).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.kdf import hkdf
from fedmqtt.secagg.ring import EXACT_FLOAT_LIMIT
from fedmqtt.secagg.weighted import Layout, layout_of

NOISE_KEY = "dp-noise"
COUNT_NOISE_KEY = b"dp-count-noise"  # HKDF info: the count entry's noise key from the site's noise key
# Integer orders only: the Skellam RDP bound is stated for integer alpha > 1.
ORDERS: tuple[int, ...] = (*range(2, 129), 160, 192, 256, 384, 512, 1024)
HEADROOM_STDS = 12.0  # the ring must hold the sum plus this many standard deviations of its noise
NUMPY_POISSON_MAX = 1e18  # numpy refuses a Poisson mean near 2^63


@dataclass(frozen=True)
class SkellamPlan:
    """The public parameters of one round's distributed noise, as the PS and every site derive them."""

    clip: float  # C: the L2 norm each site's change is clipped to (model units)
    noise_multiplier: float  # z: the sum of `expected_sites` sites carries noise of std z Delta_2
    expected_sites: int  # the sites the noise is calibrated for (fewer in the sum: less noise, more epsilon)
    fraction_bits: int  # the ring's scale gamma = 2^fraction_bits
    dim: int  # d: the coordinates of the change
    # Adaptive clipping (Andrew et al.): > 0, the sum of `expected_sites` sites' clipped-count entries (each
    # b_i - 1/2, b_i = 1 when the change's norm was within the clip) carries noise of this std, in sites
    count_stddev: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"distributed DP: the clip must be a positive number, not {self.clip}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise ValueError(f"distributed DP: the noise multiplier must be positive, not {self.noise_multiplier}")
        if self.expected_sites < 1 or self.dim < 1:
            raise ValueError(f"distributed DP: expected_sites ({self.expected_sites}) and dim ({self.dim}) must be "
                             ">= 1")
        if not (math.isfinite(self.count_stddev) and self.count_stddev >= 0):
            raise ValueError(f"distributed DP: the count's noise must be a number >= 0, not {self.count_stddev}")
        if self.count_stddev and self.fraction_bits < 1:
            raise ValueError("distributed DP with adaptive clipping needs fraction_bits >= 1 (each site's clipped "
                             "count entry, b - 1/2, must be a whole number of ring units)")
        if max(self.site_variance, self.count_site_variance) / 2 > NUMPY_POISSON_MAX:
            raise ValueError(f"distributed DP: a site's noise variance {self.site_variance:.3g} is beyond what the "
                             "sampler draws: lower fraction_bits or the noise multiplier")

    @property
    def scale(self) -> float:
        return float(2**self.fraction_bits)

    @property
    def l2(self) -> float:
        """Delta_2 in ring units: gamma C plus the rounding's sqrt(d) / 2."""
        return self.scale * self.clip + math.sqrt(self.dim) / 2.0

    @property
    def l1(self) -> float:
        """Delta_1 in ring units: sqrt(d) Delta_2 (Cauchy-Schwarz)."""
        return math.sqrt(self.dim) * self.l2

    @property
    def site_variance(self) -> float:
        """v_site: each site's share of the variance (per coordinate, ring units)."""
        return (self.noise_multiplier * self.l2) ** 2 / self.expected_sites

    @property
    def count_l(self) -> float:
        """Delta_1 = Delta_2 of the clipped-count entry in ring units: b - 1/2 moves by at most 1/2 (gamma / 2)."""
        return self.scale / 2.0

    @property
    def count_site_variance(self) -> float:
        """Each site's share of the count entry's noise variance (ring units); 0 without adaptive clipping."""
        return (self.count_stddev * self.scale) ** 2 / self.expected_sites

    @property
    def effective_multiplier(self) -> float:
        """The one Gaussian multiplier the change and count releases together amount to (Andrew et al.):
        (z^-2 + (2 sigma_b)^-2)^(-1/2); z without the count."""
        if not self.count_stddev:
            return self.noise_multiplier
        return float((self.noise_multiplier**-2 + (2.0 * self.count_stddev) ** -2) ** -0.5)

    def releases(self, sites: int) -> list[tuple[float, float, float]]:
        """What one round with `sites` sites' shares in the sum releases, as (Delta_1, Delta_2, variance) for the
        accountant: the change, and the clipped count with adaptive clipping (independent noise on another
        coordinate: their RDPs add)."""
        out = [(self.l1, self.l2, sites * self.site_variance)]
        if self.count_stddev:
            out.append((self.count_l, self.count_l, sites * self.count_site_variance))
        return out

    def sum_std(self, sites: int) -> float:
        """The std of one coordinate of the noise on the decoded sum of `sites` sites (model units)."""
        return math.sqrt(sites * self.site_variance) / self.scale

    def ring_reach(self, max_sites: int) -> float:
        """How far from 0 a coordinate of the sum of `max_sites` sites can reach, noise to HEADROOM_STDS std."""
        change = max_sites * (self.scale * self.clip + 0.5) + HEADROOM_STDS * math.sqrt(max_sites * self.site_variance)
        if not self.count_stddev:
            return change
        count = max_sites * self.count_l + HEADROOM_STDS * math.sqrt(max_sites * self.count_site_variance)
        return max(change, count)


def ring_limit(bits: int) -> int:
    """The largest |coordinate| of a sum the ring decodes exactly (signed range, and float64's exact integers)."""
    return min(2 ** (bits - 1) - 1, EXACT_FLOAT_LIMIT)


def reach_problem(plan: SkellamPlan, n_sites: int, bits: int) -> str | None:
    """Why the ring cannot hold the sum of `n_sites` sites' changes and noise (None when it can). A sum that
    wrapped would decode to garbage (no privacy lost: the wrap comes after the noise)."""
    reach, limit = plan.ring_reach(n_sites), ring_limit(bits)
    if reach > limit:
        return (f"distributed DP: the sum of {n_sites} sites' changes and noise reaches {reach:.3g}, beyond the "
                f"{limit} a {bits}-bit ring decodes: lower fraction_bits, clip_norm or noise_multiplier, or use "
                "ring_bits = 64")
    return None


def clip_l2(vector: npt.NDArray[np.floating], clip: float) -> npt.NDArray[np.float64]:
    """`vector` scaled down to L2 norm `clip` when it is longer; refuses NaN and infinities."""
    wide = np.asarray(vector, dtype=np.float64)
    if not np.all(np.isfinite(wide)):
        raise ValueError("distributed DP clips finite changes only (NaN or infinity in the update)")
    norm = float(np.linalg.norm(wide))
    return wide * (clip / norm) if norm > clip else wide


def noise_key(ctx: RoundContext, cipher_private: bytes, site: str) -> bytes:
    """The 256-bit key of one site's noise in one try of one round (see the module text)."""
    return hkdf(cipher_private, ctx.bind(NOISE_KEY, site))


def skellam_noise(key: bytes, length: int, variance: float) -> npt.NDArray[np.int64]:
    """`length` independent Sk(variance) draws: Poisson(variance / 2) minus Poisson(variance / 2), from a generator
    seeded with `key` (32 bytes of secret randomness)."""
    if len(key) < 16:
        raise ValueError("the noise key must hold at least 128 bits")
    if variance <= 0:
        return np.zeros(length, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(int.from_bytes(key, "big"))))
    half = variance / 2.0
    return rng.poisson(half, length).astype(np.int64) - rng.poisson(half, length).astype(np.int64)


def skellam_rdp(order: int, l1: float, l2: float, variance: float) -> float:
    """RDP at integer `order` > 1 of one Skellam release of variance `variance` (see the module text)."""
    if order < 2 or int(order) != order:
        raise ValueError(f"the Skellam RDP bound holds for integer orders > 1, not {order}")
    if variance <= 0:
        return math.inf
    a, v = float(order), float(variance)
    return a * l2**2 / (2 * v) + min(((2 * a - 1) * l2**2 + 6 * l1) / (4 * v**2), 3 * l1 / (2 * v))


def skellam_epsilon(releases: Sequence[tuple[float, float, float]], delta: float) -> float:
    """epsilon at `delta` of the composition of Skellam releases, each (Delta_1, Delta_2, variance of the sum),
    in ring units: one a round."""
    if not releases:
        return 0.0
    if min(v for _, _, v in releases) <= 0:
        return math.inf
    import warnings

    from opacus.accountants.analysis.rdp import get_privacy_spent  # torch: only the PS of a DP run needs it

    rdp = [sum(skellam_rdp(a, l1, l2, v) for l1, l2, v in releases) for a in ORDERS]
    with warnings.catch_warnings():
        # the best order at the edge of ORDERS (alpha = 2 for a large epsilon): still an upper bound
        warnings.filterwarnings("ignore", message="Optimal order is the")
        eps, _ = get_privacy_spent(orders=list(ORDERS), rdp=rdp, delta=delta)
    return float(eps)


def change_vector(changes: Mapping[str, np.ndarray], layout: Layout, clip: float,
                  count: bool = False) -> npt.NDArray[np.float64]:
    """What a site encodes under distributed DP: its model change (float tensors in `layout`'s order, flattened)
    clipped to L2 norm `clip` as one vector, then, in the weight's slot, 0 (the PS divides by a fixed number of
    sites, never by a sum of weights, and knows who is in the sum) or, with adaptive clipping (`count`), its
    clipped-count entry b - 1/2: +1/2 when the change's norm was within `clip`, else -1/2 (Andrew et al.: centred,
    so one site moves the sum by at most 1/2)."""
    if layout.variates or layout.normalised:
        raise ValueError("distributed DP sums model changes only (no control variates, no normalised updates)")
    if layout_of(changes) != layout:
        raise ValueError("the change's float tensors do not match the round's layout (names, shapes or dtypes)")
    flat = np.concatenate([np.asarray(changes[n], dtype=np.float64).ravel() for n in layout.names])
    clipped = clip_l2(flat, clip)
    entry = (0.5 if float(np.linalg.norm(flat)) <= clip else -0.5) if count else 0.0
    return np.concatenate([clipped, np.array([entry])])


def site_noise(plan: SkellamPlan, key: bytes, layout: Layout) -> npt.NDArray[np.int64]:
    """The site's share of the noise for every coordinate of `change_vector`'s: the change's, and the count
    entry's with adaptive clipping (from a key of its own, HKDF of `key`), else none on the weight's slot."""
    if plan.dim != layout.floats:
        raise ValueError(f"the plan is for {plan.dim} coordinates, the layout has {layout.floats}")
    count = skellam_noise(hkdf(key, COUNT_NOISE_KEY), 1, plan.count_site_variance)
    return np.concatenate([skellam_noise(key, layout.floats, plan.site_variance), count])
