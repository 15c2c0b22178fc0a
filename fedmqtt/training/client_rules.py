"""Client-side rules of the algorithms (docs/algorithms.md 2-8, 14): what a site adds to its local
gradient, and what it computes after local training (uplink extras, its own persistent state).

Every term is written into the gradient explicitly (not delegated to optimizer weight decay),
on TRAIN parameters only, never on buffers (docs/algorithms.md 0.2, 19.1 items 6, 7, 9).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.messages import TrainSettings

log = logging.getLogger(__name__)
Weights = dict[str, np.ndarray]
SGD_ONLY = {"scaffold": "SCAFFOLD option II", "fednova": "FedNova's ||a_i||_1"}
# Algorithms whose client rule adds nothing to the gradient: under record-level DP the clipped, noised gradient is
# the whole step. FedProx/FedPxN/FedDyn/SCAFFOLD add terms and FedFBN freezes layers inside it (plan_terms).
DP_ALGORITHMS = frozenset({"base", "fedavg", "fedadam", "fedyogi", "fedadagrad", "fedbn", "fedper", "fednova",
                           "fedadp", "feddkw", "dp-fedavg"})


@dataclass(frozen=True)
class GradTerms:
    """Additions to the minibatch gradient of named parameters, anchored on the round's start weights."""

    prox_mu: float = 0.0
    prox_names: frozenset[str] = frozenset()
    dyn_alpha: float = 0.0
    dyn_s: Mapping[str, np.ndarray] = field(default_factory=dict)  # FedDyn: + alpha*(s_i + w - theta_send)
    shift: Mapping[str, np.ndarray] = field(default_factory=dict)  # SCAFFOLD: + (c - c_i)
    freeze_norm: bool = False  # FedFBN: BN layers in eval mode and not trained
    # FedDyn: the gradient of the loss plus alpha*(s_i - theta_send) clipped to this L2 norm before alpha*w is
    # added, as its authors' code does (loop._gradient_terms); 0: off
    clip_norm: float = 0.0


def optimiser_problem(algorithm: str, optimizer: str, hyper: Mapping[str, Any]) -> str | None:
    """Why `algorithm`'s client rule cannot run with this local optimiser, with the fix; None when it can.

    SCAFFOLD option II and FedNova's ||a_i||_1 are defined for SGD; SCAFFOLD's c_i estimate also assumes
    no momentum (FedNova's ||a_i||_1 has a momentum form, so FedNova accepts momentum).
    """
    if algorithm not in SGD_ONLY:
        return None
    if optimizer != "sgd":
        return f'{algorithm} needs SGD for {SGD_ONLY[algorithm]} (got {optimizer}): set train.optimizer = "sgd"'
    if algorithm == "scaffold" and (float(hyper.get("momentum", 0.0)) or float(hyper.get("nesterov", 0.0))):
        return "scaffold needs SGD without momentum (SCAFFOLD option II's c_i estimate): drop momentum/nesterov"
    return None


def record_dp_problem(algorithm: str, hyper: Mapping[str, Any]) -> str | None:
    """Why record-level DP-SGD (docs/privacy.md) cannot train with this algorithm and these keys; None if it can.
    Torch-free, so the PS refuses such a config before it starts."""
    if algorithm not in DP_ALGORITHMS:
        return (f"record-level DP supports algorithms whose local step is the plain gradient step "
                f"({', '.join(sorted(DP_ALGORITHMS))}), not {algorithm!r}")
    if hyper.get("feature_stats", 0):
        return "record-level DP cannot send AdaFed's feature statistics: they are computed from the records unnoised"
    if hyper.get("balance_classes", 0):
        return "record-level DP cannot weigh the loss by the site's class counts (balance_classes): they are not noised"
    return None


def _train_names(manifest: Mapping[str, Any]) -> list[str]:
    return sorted(n for n, spec in manifest.items() if "TRAIN" in spec["tags"])


def _is_norm(spec: Mapping[str, Any]) -> bool:
    return any(t.startswith("NORM:") for t in spec["tags"])


def plan_terms(settings: TrainSettings, manifest: Mapping[str, Any], *, extras: Mapping[str, Weights],
               local: Mapping[str, Weights], round_no: int = 0) -> GradTerms:
    """The gradient terms of `settings.algorithm` for round `round_no`."""
    algo, hyper = settings.algorithm, settings.hyper
    if algo in ("fedprox", "fedpxn") and round_no == 1 and hyper.get("prox_skip_first_round"):
        return GradTerms()  # Hwang et al.'s variant: no proximal term in round 1 (option, off by default)
    train = _train_names(manifest)
    problem = optimiser_problem(algo, settings.optimizer, hyper)
    if problem:
        raise ValueError(problem)
    if algo == "fedprox":
        return GradTerms(prox_mu=float(hyper.get("mu", 0.0)), prox_names=frozenset(train))
    if algo == "fedpxn":  # proximal term on non-normalization parameters only (paper; 19.1 item 7)
        names = frozenset(n for n in train if not _is_norm(manifest[n]))
        return GradTerms(prox_mu=float(hyper.get("mu", 0.0)), prox_names=names)
    if algo == "feddyn":
        s_i = local.get("s_i") or {n: np.zeros(manifest[n]["shape"], np.float32) for n in train}
        # Imported here: `fedmqtt.strategies` loads every server rule, which a site never runs
        from fedmqtt.strategies.feddyn import DEFAULT_MAX_GRAD_NORM

        clip = float(hyper.get("max_grad_norm", DEFAULT_MAX_GRAD_NORM))
        return GradTerms(dyn_alpha=float(hyper["alpha"]), dyn_s=s_i, clip_norm=clip)
    if algo == "scaffold":
        c = extras.get("c") or {}
        c_i = local.get("c_i") or {}
        zeros = {n: np.zeros(manifest[n]["shape"], np.float32) for n in train}
        return GradTerms(shift={n: c.get(n, zeros[n]) - c_i.get(n, zeros[n]) for n in train})
    if algo == "fedfbn":
        return GradTerms(freeze_norm=True)
    return GradTerms()


def finish_round(settings: TrainSettings, manifest: Mapping[str, Any], *, start: Weights, end: Weights,
                 steps: int, extras: Mapping[str, Weights], local: Mapping[str, Weights]
                 ) -> tuple[dict[str, Any], dict[str, Weights]]:
    """Uplink extras and the site's new algorithm state (pending until the PS accepts the update)."""
    algo, hyper = settings.algorithm, settings.hyper
    train = _train_names(manifest)
    if algo == "scaffold":  # option II: c_i+ = c_i - c + (x - y) / (K * eta_l)
        c = extras.get("c") or {}
        c_i = local.get("c_i") or {}
        zero = {n: np.zeros(manifest[n]["shape"], np.float32) for n in train}
        scale = 1.0 / (max(steps, 1) * settings.lr)
        new = {n: (c_i.get(n, zero[n]) - c.get(n, zero[n]) + (start[n] - end[n]) * scale).astype(np.float32)
               for n in train}
        delta = {n: (new[n] - c_i.get(n, zero[n])).astype(np.float32) for n in train}
        return {"delta_c": delta}, {"c_i": new}
    if algo == "feddyn":  # s_i <- s_i + (theta_i - theta_send)
        s_i = local.get("s_i") or {n: np.zeros(manifest[n]["shape"], np.float32) for n in train}
        return {}, {"s_i": {n: (s_i[n] + end[n] - start[n]).astype(np.float32) for n in train}}
    if algo == "fednova":
        # The same keys the optimiser was built from (loop._make_optimizer): ||a_i||_1 follows the momentum used.
        return {"a_norm": fednova_a_norm(steps, lr=settings.lr, rho=float(hyper.get("momentum", 0.0)),
                                         mu=float(hyper.get("mu", 0.0)),
                                         nesterov=bool(hyper.get("nesterov", 0.0)))}, {}
    return {}, {}


def fednova_a_norm(steps: int, *, lr: float, rho: float = 0.0, mu: float = 0.0, nesterov: bool = False) -> float:
    """||a_i||_1 of FedNova (docs/algorithms.md 8): tau for SGD; running forms for momentum and proximal SGD.

    Heavy ball (PyTorch form, fresh buffer b): step s moves by b_s = rho b_{s-1} + g_s, so gradient g_s
    enters with weight sum_{t>=s} rho^(t-s). Nesterov moves by g_s + rho b_s: each step adds 1 + rho b-count.
    """
    a, counter = 0.0, 0.0
    for _ in range(steps):
        if rho > 0:
            counter = rho * counter + 1.0
            a += 1.0 + rho * counter if nesterov else counter
        elif mu > 0:
            a = a * (1.0 - lr * mu) + 1.0
        else:
            a += 1.0
    return a
