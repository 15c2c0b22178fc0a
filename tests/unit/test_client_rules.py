"""Client-side rules through the real gradient-term code: docs/algorithms.md 0.7 toy numbers, FedNova norms,
FedPxN's norm exclusion, FedFBN freezing, and the commit rule of the site's local state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedmqtt.training.client_rules import GradTerms, fednova_a_norm, finish_round, plan_terms  # noqa: E402
from fedmqtt.training.loop import _gradient_terms, train_local  # noqa: E402
from fedmqtt.training.models import build_model, tensor_manifest  # noqa: E402
from fedmqtt.training.weights import initial_arrays, load_arrays, state_to_arrays  # noqa: E402
from schemas.messages import TrainSettings  # noqa: E402
from site_agent.local_state import BestSlot, LocalState  # noqa: E402

LR = 0.1
# The toy's one scalar parameter, as the site-side manifest would describe it.
TOY_MANIFEST = {"w": {"shape": [], "dtype": "float64", "tags": ["TRAIN"]}}
BN_ARGS = {"in_features": 15, "hidden": [16], "norm": "bn"}
BN_STATE = ("blocks.1.weight", "blocks.1.bias", "blocks.1.running_mean", "blocks.1.running_var",
            "blocks.1.num_batches_tracked")


class Scalar(torch.nn.Module):
    """One scalar parameter named "w" (float64, so the toy's printed digits are exact)."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(start, dtype=torch.float64))


def _toy_steps(start: float, a: float, terms: GradTerms, steps: int = 2) -> list[float]:
    """Plain SGD (lr 0.1) on 0.5*(w-a)^2 plus the terms' gradient; the anchor is `start`."""
    model = Scalar(start)
    correct = _gradient_terms(model, terms, torch.device("cpu"))
    assert correct is not None
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    path = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        (0.5 * (model.w - a) ** 2).backward()
        correct()
        optimizer.step()
        path.append(float(model.w.detach()))
    return path


def _settings(algorithm: str, optimizer: str = "sgd", **hyper: float) -> TrainSettings:
    return TrainSettings(algorithm=algorithm, optimizer=optimizer, lr=LR, hyper=hyper)


def _scalar(value: float) -> dict[str, np.ndarray]:
    return {"w": np.array(value, dtype=np.float64)}


def _toy_data(n: int = 96, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 15)).astype(np.float32)
    return x, (x[:, 0] - x[:, 2] > 0).astype(np.int64)


def _bn_model() -> Any:
    model = build_model("mlp", BN_ARGS)
    load_arrays(model, initial_arrays("mlp", BN_ARGS, 3))
    return model


# -- docs/algorithms.md 0.7 toy through the real gradient terms --------------------------------------
@pytest.mark.parametrize(("a", "expected"), [(1.0, [0.1, 0.185]), (5.0, [0.5, 0.925])])
def test_fedprox_toy_matches_algorithms_md(a: float, expected: list[float]) -> None:
    """FedProx mu=0.5 from anchor 0: 0.1 -> 0.185 (client 1) and 0.5 -> 0.925 (client 2)."""
    # Prepare
    terms = plan_terms(_settings("fedprox", mu=0.5), TOY_MANIFEST, extras={}, local={})
    # Execute
    path = _toy_steps(0.0, a, terms)
    # Assert
    assert terms.prox_names == frozenset({"w"})
    assert path == pytest.approx(expected, abs=1e-12)


def test_feddyn_round2_client1_toy_matches_algorithms_md() -> None:
    """FedDyn round 2, client 1 (theta 1.134, s_1 0.189, alpha 0.1): 1.11871, 1.1051019; s_1 0.1601019."""
    # Prepare
    settings = _settings("feddyn", alpha=0.1)
    local = {"s_i": _scalar(0.189)}
    terms = plan_terms(settings, TOY_MANIFEST, extras={}, local=local)
    # Execute
    path = _toy_steps(1.134, 1.0, terms)
    _, state = finish_round(settings, TOY_MANIFEST, start=_scalar(1.134), end=_scalar(path[-1]), steps=2,
                            extras={}, local=local)
    # Assert
    assert path == pytest.approx([1.11871, 1.1051019], abs=1e-12)
    assert float(state["s_i"]["w"]) == pytest.approx(0.1601019, abs=1e-6)  # float32 on the wire


def test_scaffold_round2_client1_toy_matches_algorithms_md() -> None:
    """SCAFFOLD round 2, client 1 (x 0.57, c -2.85, c_1 -0.95): 0.803, 1.0127; option II c_1 = -0.3135."""
    # Prepare
    settings = _settings("scaffold")
    extras, local = {"c": _scalar(-2.85)}, {"c_i": _scalar(-0.95)}
    terms = plan_terms(settings, TOY_MANIFEST, extras=extras, local=local)
    # Execute
    path = _toy_steps(0.57, 1.0, terms)
    uplink, state = finish_round(settings, TOY_MANIFEST, start=_scalar(0.57), end=_scalar(path[-1]), steps=2,
                                 extras=extras, local=local)
    # Assert
    assert path == pytest.approx([0.803, 1.0127], abs=1e-12)
    assert float(state["c_i"]["w"]) == pytest.approx(-0.3135, abs=1e-6)
    assert float(uplink["delta_c"]["w"]) == pytest.approx(-0.3135 - (-0.95), abs=1e-6)


def test_fedpxn_gives_normalization_parameters_exactly_zero_proximal_gradient() -> None:
    """FedPxN's proximal term reaches every non-NORM TRAIN parameter and no BatchNorm one."""
    # Prepare: a real BN-MLP and its manifest; every parameter moved 1.0 away from the anchor.
    model = _bn_model()
    manifest = tensor_manifest(model)
    terms = plan_terms(_settings("fedpxn", mu=0.5), manifest, extras={}, local={})
    correct = _gradient_terms(model, terms, torch.device("cpu"))
    assert correct is not None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
            p.grad = torch.zeros_like(p)
    # Execute
    correct()
    # Assert
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert terms.prox_names == frozenset({"blocks.0.weight", "blocks.0.bias", "head.weight", "head.bias"})
    for name in ("blocks.1.weight", "blocks.1.bias"):
        assert torch.count_nonzero(grads[name]) == 0, name
    for name in terms.prox_names:
        torch.testing.assert_close(grads[name], torch.full_like(grads[name], 0.5), msg=name)  # mu * (w - w_t)
    fedprox = plan_terms(_settings("fedprox", mu=0.5), manifest, extras={}, local={})
    assert {"blocks.1.weight", "blocks.1.bias"} <= fedprox.prox_names  # FedProx: all TRAIN tensors


# -- FedNova's ||a_i||_1 and the SGD-only rules -------------------------------------------------
def test_fednova_a_norm_matches_algorithms_md() -> None:
    """||a||_1: tau for plain SGD, 5.61 for momentum 0.9 x3, 2.8525 for proximal eta*mu = 0.05 x3."""
    # Execute / Assert
    assert fednova_a_norm(3, lr=LR) == 3.0
    assert fednova_a_norm(4, lr=LR) == 4.0
    assert fednova_a_norm(3, lr=LR, rho=0.9) == pytest.approx(5.61, abs=1e-12)
    assert fednova_a_norm(3, lr=LR, mu=0.5) == pytest.approx(2.8525, abs=1e-12)
    assert fednova_a_norm(0, lr=LR) == 0.0


@pytest.mark.parametrize(("algorithm", "rule"), [("scaffold", "SCAFFOLD option II"), ("fednova", "FedNova")])
def test_plan_terms_refuses_sgd_only_rules_with_adam(algorithm: str, rule: str) -> None:
    """SCAFFOLD and FedNova are defined for plain SGD: Adam is refused with a message naming the rule."""
    # Execute / Assert
    with pytest.raises(ValueError, match=rule):
        plan_terms(_settings(algorithm, optimizer="adam"), TOY_MANIFEST, extras={}, local={})


def test_plan_terms_refuses_scaffold_with_momentum() -> None:
    """SCAFFOLD option II needs SGD without momentum."""
    # Execute / Assert
    with pytest.raises(ValueError, match="SCAFFOLD option II"):
        plan_terms(_settings("scaffold", momentum=0.9), TOY_MANIFEST, extras={}, local={})


# -- FedFBN: frozen BatchNorm -------------------------------------------------------------------
@pytest.mark.parametrize("freeze", [True, False])
def test_fedfbn_freezing_keeps_batchnorm_bit_identical(freeze: bool) -> None:
    """Freezing keeps BN weight, bias and buffers bit-identical while Linear layers train; else they move."""
    # Prepare
    model = _bn_model()
    before = state_to_arrays(model)
    x, y = _toy_data()
    settings = TrainSettings(algorithm="fedfbn", epochs=2, batch_size=16, lr=0.05, optimizer="sgd")
    terms = plan_terms(settings, tensor_manifest(model), extras={}, local={}) if freeze else GradTerms()
    # Execute
    stats = train_local(model, x, y, settings, seed=1, terms=terms)
    after = state_to_arrays(model)
    # Assert
    assert stats.steps == 12 and terms.freeze_norm is freeze
    # Not blocks.0.bias: in front of a training-mode BN its gradient is zero up to rounding noise.
    for name in ("blocks.0.weight", "head.weight", "head.bias"):
        assert not np.array_equal(before[name], after[name]), name
    for name in BN_STATE:
        assert np.array_equal(before[name], after[name]) is freeze, name
        assert before[name].dtype == after[name].dtype, name


# -- the commit rule (docs/algorithms.md 0.6) --------------------------------------------------------
def _c(value: float) -> dict[str, dict[str, np.ndarray]]:
    return {"c_i": {"w": np.full((2,), value, dtype=np.float32)}}


def _committed_c(state: LocalState) -> np.ndarray | None:
    return state.committed().get("c_i", {}).get("w")


def test_commit_rule_commits_accepted_discards_rejected_and_keeps_a_resent_round(tmp_path: Path) -> None:
    """Pending state is committed only when the next task says it was aggregated; it survives restarts."""
    # Prepare
    state = LocalState(tmp_path / "local")
    # Execute / Assert: round 1 accepted -> committed.
    state.stage(1, _c(1.0))
    assert _committed_c(state) is None  # pending only, until the PS's verdict
    state.resolve(1, 2)  # the PS aggregated our round-1 update
    np.testing.assert_array_equal(_committed_c(state), np.full((2,), 1.0, np.float32))
    # Round 2 not aggregated (the PS's last accepted round for us is still 1) -> discarded.
    state.stage(2, _c(2.0))
    state.resolve(1, 3)
    np.testing.assert_array_equal(_committed_c(state), np.full((2,), 1.0, np.float32))
    state.resolve(1, 4)  # nothing pending any more: the same verdict again changes nothing
    np.testing.assert_array_equal(_committed_c(state), np.full((2,), 1.0, np.float32))
    # A re-sent task of the same round keeps the pending state (it belongs to this very round).
    state.stage(3, _c(3.0))
    state.resolve(1, 3)
    np.testing.assert_array_equal(_committed_c(state), np.full((2,), 1.0, np.float32))
    # A new instance on the same folder (a restarted agent) sees committed and pending state.
    reborn = LocalState(tmp_path / "local")
    np.testing.assert_array_equal(_committed_c(reborn), np.full((2,), 1.0, np.float32))
    reborn.resolve(3, 4)
    np.testing.assert_array_equal(_committed_c(reborn), np.full((2,), 3.0, np.float32))
    again = LocalState(tmp_path / "local")
    np.testing.assert_array_equal(_committed_c(again), np.full((2,), 3.0, np.float32))


def test_commit_rule_stage_keeps_groups_not_touched_this_round(tmp_path: Path) -> None:
    """Staging one group (e.g. local layers) keeps the committed value of the others (e.g. c_i)."""
    # Prepare
    state = LocalState(tmp_path / "local")
    state.stage(1, {**_c(1.0), "model": {"bn.weight": np.ones(3, np.float32)}})
    state.resolve(1, 2)
    # Execute
    state.stage(2, {"model": {"bn.weight": np.zeros(3, np.float32)}})
    state.resolve(2, 3)
    # Assert
    committed = state.committed()
    np.testing.assert_array_equal(committed["c_i"]["w"], np.full((2,), 1.0, np.float32))
    np.testing.assert_array_equal(committed["model"]["bn.weight"], np.zeros(3, np.float32))


def test_commit_rule_a_site_without_state_writes_nothing(tmp_path: Path) -> None:
    """FedAvg keeps no local state: staging nothing leaves no file to fsync, and the verdicts change nothing."""
    # Prepare
    state = LocalState(tmp_path / "local")
    # Execute
    state.stage(1, {"model": {}})
    state.resolve(1, 2)
    # Assert
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == []
    assert state.committed() == {}
    # Once state exists, even an empty group staged keeps it pending as before.
    state.stage(2, _c(2.0))
    state.resolve(2, 3)
    state.stage(3, {"model": {}})
    assert (tmp_path / "local" / "pending.msgpack").exists()
    np.testing.assert_array_equal(_committed_c(state), np.full((2,), 2.0, np.float32))


def test_commit_rule_under_sampling_commits_an_old_aggregated_update(tmp_path: Path) -> None:
    """Drawn in round 2 and next in round 6: the round-6 task says round 2 was aggregated, so it is committed."""
    # Prepare
    state = LocalState(tmp_path / "local")
    state.stage(2, _c(2.0))
    # Execute
    state.resolve(2, 6)
    # Assert
    np.testing.assert_array_equal(_committed_c(state), np.full((2,), 2.0, np.float32))


# -- the best-round slot (docs/algorithms.md 17.1) -------------------------------------------------------
def test_best_slot_promotes_the_evaluated_model_and_survives_a_torn_file(tmp_path: Path) -> None:
    """The slot is written without fsync (no part of the commit rule): a file a power loss left empty is never
    promoted nor evaluated, and the agent goes on."""
    # Prepare
    slot = BestSlot(tmp_path / "best")
    weights = {"w": np.arange(4, dtype=np.float32)}
    # Execute / Assert: round 3 evaluated, then named best
    slot.remember(3, weights)
    slot.promote(2)
    assert slot.slot() == (None, None)
    slot.promote(3)
    best_round, best = slot.slot()
    assert best_round == 3 and best is not None
    np.testing.assert_array_equal(best["w"], weights["w"])
    # An empty evaluated file (what a power loss may leave of an unsynced write) is not promoted
    (tmp_path / "best" / "evaluated.safetensors").write_bytes(b"")
    slot.promote(4)
    assert slot.slot()[0] == 3
    # An empty best file reads as no best model
    (tmp_path / "best" / "best.safetensors").write_bytes(b"")
    assert slot.slot() == (None, None)
