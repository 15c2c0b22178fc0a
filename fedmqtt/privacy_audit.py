"""An empirical check that differential privacy means something: a loss-threshold membership-inference attack.

Yeom, Giacomelli, Fredrikson and Jha (Privacy risk in machine learning: analyzing the connection to
overfitting): a model's loss is lower on the records it was trained on, so an attacker who sees a record and
the model guesses "member" when the record's loss is below a threshold. Sweeping the threshold gives the
attack's ROC curve; its AUC is 0.5 when members and non-members are indistinguishable by their loss, and a
model trained with (epsilon, delta)-DP bounds every such attack (its true-positive rate is at most
e^epsilon times its false-positive rate plus delta), so the AUC must fall towards 0.5 as epsilon falls.

Members are a model's training records, non-members records of the same population it never saw (held-out
rows). Numpy and scikit-learn only: the per-record losses are computed from a binary model's logits, made
elsewhere (fedmqtt.training.evaluate.predict_logits). Logits, not probabilities: a float32 sigmoid saturates at
1 - 6e-8, which would tie the most confident records' losses and blunt the attack.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.metrics import roc_auc_score


@dataclass(frozen=True)
class MembershipAudit:
    """The attack's result on one model."""

    auc: float  # ROC AUC of the score -loss, members the positive class (0.5: no better than guessing)
    advantage: float  # Yeom et al.'s: TPR - FPR at the threshold "loss below the members' mean loss"
    threshold: float  # that threshold
    n_members: int
    n_nonmembers: int


def binary_log_losses(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Each record's binary cross-entropy, log(1 + exp(-z)) for label 1 and log(1 + exp(z)) for 0, from its
    logit z (computed without overflow)."""
    z = _vector(logits, "logits")
    y = _vector(labels, "labels")
    if z.shape != y.shape:
        raise ValueError(f"{z.shape[0]} logits for {y.shape[0]} labels")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("binary labels must be 0 or 1")
    return np.logaddexp(0.0, -(2.0 * y - 1.0) * z)


def membership_audit(member_losses: np.ndarray, nonmember_losses: np.ndarray) -> MembershipAudit:
    """The loss-threshold attack on per-record losses of members (training records) and non-members."""
    members = _vector(member_losses, "member losses")
    others = _vector(nonmember_losses, "non-member losses")
    if members.size == 0 or others.size == 0:
        raise ValueError("the attack needs at least one member and one non-member")
    truth = np.concatenate([np.ones(members.size), np.zeros(others.size)])
    auc = float(roc_auc_score(truth, -np.concatenate([members, others])))
    threshold = float(members.mean())
    advantage = float((members < threshold).mean() - (others < threshold).mean())
    return MembershipAudit(auc, advantage, threshold, int(members.size), int(others.size))


def _vector(values: np.ndarray, what: str) -> np.ndarray:
    out = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.isfinite(out).all():
        raise ValueError(f"{what} must be finite")
    return out
