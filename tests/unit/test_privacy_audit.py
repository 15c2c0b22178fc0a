"""The loss-threshold membership-inference attack (fedmqtt.privacy_audit): it finds the members of an overfit
model, and record-level DP-SGD with a small epsilon takes that away (its AUC falls towards 0.5)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedmqtt.privacy_audit import binary_log_losses, membership_audit

torch = pytest.importorskip("torch")


def test_losses_are_binary_cross_entropy() -> None:
    z = np.log(9.0)  # probability 0.9
    losses = binary_log_losses(np.array([z, z, 0.0, 800.0]), np.array([1, 0, 1, 0]))
    np.testing.assert_allclose(losses, [-np.log(0.9), -np.log(0.1), np.log(2), 800.0])


def test_separated_losses_give_auc_one_and_full_advantage() -> None:
    audit = membership_audit(np.array([0.01, 0.02, 0.03]), np.array([1.0, 2.0, 3.0, 4.0]))
    assert audit.auc == 1.0
    assert audit.advantage == pytest.approx(1 / 3)  # one of three members below their mean, no non-member
    assert (audit.n_members, audit.n_nonmembers) == (3, 4)


@given(st.lists(st.floats(0, 10), min_size=1, max_size=30), st.lists(st.floats(0, 10), min_size=1, max_size=30))
def test_auc_is_a_probability_and_mirrors_when_roles_swap(a: list[float], b: list[float]) -> None:
    ab, ba = membership_audit(np.array(a), np.array(b)).auc, membership_audit(np.array(b), np.array(a)).auc
    assert 0.0 <= ab <= 1.0
    assert ab + ba == pytest.approx(1.0)


@pytest.mark.parametrize("members, others", [([], [1.0]), ([1.0], []), ([np.nan], [1.0]), ([1.0], [np.inf])])
def test_refuses_empty_or_non_finite_losses(members: list[float], others: list[float]) -> None:
    with pytest.raises(ValueError):
        membership_audit(np.array(members), np.array(others))


def test_refuses_bad_logits_and_labels() -> None:
    with pytest.raises(ValueError):
        binary_log_losses(np.array([np.inf]), np.array([1]))
    with pytest.raises(ValueError):
        binary_log_losses(np.array([0.5]), np.array([2]))
    with pytest.raises(ValueError):
        binary_log_losses(np.array([0.5, 0.5]), np.array([1]))


# -- the attack on real models: the bundled heart-disease data of one hospital -----------------------------------
MEMBERS = 20  # a tiny training set, so the plain model memorises it (with 40, its AUC was about 0.6)


def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from fedmqtt.data.heart_disease import bundled_path
    from fedmqtt.data.registry import load_site_data
    from fedmqtt.data.spec import DataSpec

    d = load_site_data(DataSpec(format="heart_disease", path=bundled_path("cleveland")))
    x = np.concatenate([d.x_train, d.x_val, d.x_test]).astype(np.float32)
    y = np.concatenate([d.y_train, d.y_val, d.y_test]).astype(np.float32)
    return x[:MEMBERS], y[:MEMBERS], x[MEMBERS:], y[MEMBERS:]


def _auc(model: torch.nn.Module, xm: np.ndarray, ym: np.ndarray, xo: np.ndarray, yo: np.ndarray) -> float:
    from fedmqtt.training.evaluate import predict_logits

    return membership_audit(binary_log_losses(predict_logits(model, xm), ym),
                            binary_log_losses(predict_logits(model, xo), yo)).auc


def _model() -> torch.nn.Module:
    from fedmqtt.training.models import build_model

    torch.manual_seed(0)
    return build_model("mlp", {"in_features": 15, "hidden": [64, 64], "norm": "none"})


def test_the_attack_finds_an_overfit_models_members_and_dp_sgd_hides_them() -> None:
    pytest.importorskip("opacus")  # the `privacy` extra
    from fedmqtt.training.loop import train_local
    from fedmqtt.training.privacy import train_local_dp
    from schemas.messages import RecordDP, TrainSettings

    xm, ym, xo, yo = _split()
    # weight decay keeps the non-members' confident predictions from reaching the members' near-zero losses
    settings = TrainSettings(epochs=50, batch_size=8, lr=0.01, optimizer="adamw", weight_decay=0.05)
    plain = _model()
    train_local(plain, xm, ym, settings, seed=0)
    plain_auc = _auc(plain, xm, ym, xo, yo)
    private = _model()
    dp = RecordDP(max_grad_norm=1.0, target_epsilon=0.5, planned_rounds=1)
    train_local_dp(private, xm, ym, settings, dp, history=[], seed=0)
    private_auc = _auc(private, xm, ym, xo, yo)
    # the AUC's standard error with 20 members and 283 non-members is about 0.07 under the null
    assert plain_auc > 0.65, plain_auc  # the members' losses are lower: the attack works (0.73 when written)
    # epsilon 0.5 bounds any attack's TPR by e^0.5 FPR + delta
    assert abs(private_auc - 0.5) < 0.15, private_auc
    assert plain_auc - private_auc > 0.1  # 0.73 against 0.57 when written
