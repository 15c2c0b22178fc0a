"""Every registered rule: names, params, tag-based sharing, buffer rules, state round trips (msgpack)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import (
    STRATEGIES,
    AdaFed,
    AggregateResult,
    RoundInput,
    RoundRequirements,
    ServerRule,
    SiteUpdate,
    TensorSpec,
    build_strategy,
    describe_strategies,
)

NAMES = [
    "fedavg", "fedprox", "fedbn", "fedpxn", "fedadam", "fedadagrad", "fedyogi", "feddyn", "scaffold",
    "fednova", "fedadp", "feddkw", "adafed", "d-adafed", "f-adafed", "fedfbn", "fedper", "base", "dp-fedavg",
]  # fmt: skip


def _spec(name: str, shape: tuple[int, ...], *tags: str, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name, shape, dtype, frozenset(tags))


MANIFEST = {
    "fc.weight": _spec("fc.weight", (3,), "TRAIN"),
    "bn.weight": _spec("bn.weight", (2,), "TRAIN", "NORM:BatchNorm1d"),
    "bn.running_var": _spec("bn.running_var", (2,), "FLOATBUF", "NORM:BatchNorm1d"),
    "bn.num_batches_tracked": _spec(
        "bn.num_batches_tracked", (), "INTBUF", "NORM:BatchNorm1d", dtype="int64"
    ),
    "emb.scale": _spec("emb.scale", (2,), "FLOATBUF"),
    "counter": _spec("counter", (), "INTBUF", dtype="int64"),
    "head.weight": _spec("head.weight", (2, 3), "TRAIN", "HEAD"),
    "head.bias": _spec("head.bias", (2,), "TRAIN", "HEAD"),
}
SITES = ("site-a", "site-b", "site-c")
ENROLLED = {"site-a": 10, "site-b": 30, "site-c": 20}
STATS = {
    s: {"bn": (np.array([float(k), 0.0]), np.array([1.0, 1.0 + k]))} for k, s in enumerate(SITES)
}  # distinct per site


# f-adafed: a one-round warm-up; dp-fedavg: a fixed noise seed, so two instances draw the same noise
PARAMS: dict[str, dict[str, float]] = {"f-adafed": {"warmup_rounds": 1}, "dp-fedavg": {"noise_seed": 7}}


def _rule(name: str) -> ServerRule:
    """A rule ready to aggregate: AdaFed variants get statistics, f-adafed a one-round warm-up."""
    rule = build_strategy(name, PARAMS.get(name))
    if isinstance(rule, AdaFed):
        rule.set_statistics(STATS)
    return rule


def _tensor(spec: TensorSpec, value: float) -> np.ndarray:
    return np.full(spec.shape, value, dtype=spec.dtype)


def _input(rule: ServerRule, round_no: int, current: dict[str, np.ndarray] | None = None) -> RoundInput:
    """Three sites with distinct tensors and every algorithm's uplink extras."""
    shared = rule.shared_names(MANIFEST)
    current = current if current is not None else {n: _tensor(MANIFEST[n], 0.0) for n in shared}
    rng = np.random.default_rng(round_no)
    updates = []
    for k, site in enumerate(SITES):
        tensors = {}
        for n in shared:
            spec = MANIFEST[n]
            if spec.is_intbuf:
                tensors[n] = np.array(10 * round_no + k, dtype=np.int64)
            else:
                tensors[n] = rng.normal(size=spec.shape).astype(spec.dtype)
        extras: dict[str, Any] = {
            "delta_c": {
                n: rng.normal(size=MANIFEST[n].shape).astype(np.float32)
                for n in shared
                if MANIFEST[n].is_train
            },
            "a_norm": 2.0 + k,
            "label_histogram": {"0": 5 + k, "1": 5 - k},
            "label_set": ((0,), (0, 1), (1,))[k],  # FedFBN surgical: the head rows (labels) each site annotates
        }
        updates.append(SiteUpdate(site, tensors, ENROLLED[site], 2 + k, extras=extras))
    return RoundInput(round_no, current, updates, ENROLLED, MANIFEST)


def _pack(state: dict[str, Any]) -> bytes:
    def default(obj: object) -> object:
        if isinstance(obj, np.ndarray):
            return {"__nd__": True, "dtype": obj.dtype.str, "shape": list(obj.shape), "data": obj.tobytes()}
        raise TypeError(f"not msgpack-friendly: {type(obj)!r}")

    return msgpack.packb(state, default=default, use_bin_type=True, strict_types=False)


def _unpack(data: bytes) -> dict[str, Any]:
    def hook(obj: dict[str, Any]) -> object:
        if obj.get("__nd__"):
            return np.frombuffer(obj["data"], dtype=obj["dtype"]).reshape(obj["shape"]).copy()
        return obj

    return msgpack.unpackb(data, object_hook=hook, raw=False, strict_map_key=True)


def _assert_same_weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _assert_same_result(a: AggregateResult, b: AggregateResult) -> None:
    _assert_same_weights(a.weights, b.weights)
    assert set(a.personal) == set(b.personal) and set(a.extras) == set(b.extras)
    for site in a.personal:
        _assert_same_weights(dict(a.personal[site]), dict(b.personal[site]))
    for key in a.extras:
        _assert_same_weights(dict(a.extras[key]), dict(b.extras[key]))
    assert (a.eval_weights is None) == (b.eval_weights is None)
    if a.eval_weights is not None and b.eval_weights is not None:
        _assert_same_weights(a.eval_weights, b.eval_weights)


def test_every_name_is_registered() -> None:
    """The registry holds exactly the 18 names, each class carrying its own name and a one-line summary."""
    assert sorted(STRATEGIES) == sorted(NAMES)
    for name, cls in STRATEGIES.items():
        assert cls.name == name and cls.summary and "\n" not in cls.summary


def test_unknown_name_lists_the_known_ones() -> None:
    """build_strategy('fedsgd') is a ConfigError listing every known name."""
    with pytest.raises(ConfigError, match="unknown algorithm 'fedsgd'") as info:
        build_strategy("fedsgd")
    assert all(name in str(info.value) for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_parameter_is_a_config_error(name: str) -> None:
    """Any rule refuses an unknown key, naming itself and the key."""
    with pytest.raises(ConfigError, match=f"^{name}: unknown parameter 'bogus'"):
        build_strategy(name, {"bogus": 1.0})


@pytest.mark.parametrize("name", NAMES)
def test_params_are_frozen_with_documented_defaults(name: str) -> None:
    """Every Params field has a default and a description; the validated model is immutable."""
    rule = build_strategy(name)
    for field, info in type(rule.params).model_fields.items():
        assert not info.is_required() and info.description, field
    fields = list(type(rule.params).model_fields)
    if fields:
        with pytest.raises(ValidationError):
            setattr(rule.params, fields[0], None)


def test_describe_strategies_lists_params_with_defaults() -> None:
    """describe_strategies gives (name, summary, [(param, default, description)]) for every rule."""
    rows = {name: (summary, params) for name, summary, params in describe_strategies()}
    assert sorted(rows) == sorted(NAMES)
    assert ("mu", 0.01) in [(p, d) for p, d, _ in rows["fedprox"][1]]
    assert [p for p, _, _ in rows["fedavg"][1]] == []
    assert {p for p, _, _ in rows["fedadam"][1]} == {"weighting", "eta_g", "tau", "b1", "b2", "v_init"}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fedavg", sorted(MANIFEST)),
        ("fedbn", ["counter", "emb.scale", "fc.weight", "head.bias", "head.weight"]),
        ("fedpxn", ["counter", "emb.scale", "fc.weight", "head.bias", "head.weight"]),
        ("adafed", ["counter", "emb.scale", "fc.weight", "head.bias", "head.weight"]),
        ("fedfbn", ["counter", "emb.scale", "fc.weight", "head.bias", "head.weight"]),
        ("fedper", sorted(n for n in MANIFEST if not n.startswith("head."))),
        ("base", []),
    ],
)
def test_shared_names_follow_the_tags(name: str, expected: list[str]) -> None:
    """NORM local for FedBN/FedPxN/AdaFed/FedFBN(BN), HEAD local for FedPer, nothing shared for Base."""
    assert build_strategy(name).shared_names(MANIFEST) == expected


# dp-fedavg noises float buffers like every float (they are computed from the records) and keeps the server's
# integer buffers (a count would reveal a site's size): tests/unit/test_strategy_dp_fedavg.py checks both.
@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("base", "dp-fedavg")])
def test_float_buffers_only_get_convex_weights_and_int_buffers_the_max(name: str) -> None:
    """A float buffer equal at every site stays exactly that value (no moments, corrections, variates,
    normalisation), whatever the current value; integer buffers are the maximum; float32 stays float32."""
    # Prepare
    rule = _rule(name)
    for round_no in (1, 2):
        inp = _input(rule, round_no)
        current = {**inp.current, "emb.scale": _tensor(MANIFEST["emb.scale"], 100.0)}
        updates = [
            SiteUpdate(
                u.site_id,
                {**u.tensors, "emb.scale": _tensor(MANIFEST["emb.scale"], 2.0)},
                u.n_samples,
                u.local_steps,
                u.extras,
            )
            for u in inp.updates
        ]
        # Execute
        result = rule.aggregate_train(RoundInput(round_no, current, updates, ENROLLED, MANIFEST))
        # Assert
        models = [result.weights, *result.personal.values()]
        if result.eval_weights is not None:
            models.append(result.eval_weights)
        for model in models:
            np.testing.assert_array_equal(model["emb.scale"], _tensor(MANIFEST["emb.scale"], 2.0))
            assert model["counter"].dtype == np.int64 and int(model["counter"]) == 10 * round_no + 2
            assert model["fc.weight"].dtype == np.float32


@pytest.mark.parametrize("name", NAMES)
def test_state_round_trip_continues_identically(name: str) -> None:
    """Two rounds straight = one round, state_dict -> msgpack -> new rule -> load_state_dict, round 2."""
    # Prepare
    straight = _rule(name)
    first = straight.aggregate_train(_input(straight, 1))
    expected = straight.aggregate_train(_input(straight, 2, first.weights))
    interrupted = _rule(name)
    interrupted.aggregate_train(_input(interrupted, 1))
    # Execute
    resumed = build_strategy(name, PARAMS.get(name))
    resumed.load_state_dict(_unpack(_pack(interrupted.state_dict())))
    got = resumed.aggregate_train(_input(resumed, 2, first.weights))
    # Assert
    _assert_same_result(expected, got)
    assert _pack(resumed.state_dict()) == _pack(straight.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_round_without_participants_changes_nothing(name: str) -> None:
    """No update: the model comes back equal and the server state is untouched."""
    # Prepare
    rule = _rule(name)
    first = rule.aggregate_train(_input(rule, 1))
    before = _pack(rule.state_dict())
    # Execute
    empty = rule.aggregate_train(RoundInput(2, first.weights, [], ENROLLED, MANIFEST))
    # Assert
    _assert_same_weights(empty.weights, first.weights)
    assert not empty.personal
    assert _pack(rule.state_dict()) == before


@pytest.mark.parametrize("name", NAMES)
def test_round_hooks_ask_only_the_adafed_family_for_statistics(name: str) -> None:
    """The PS asks every rule the same two questions; only AdaFed's variants want statistics (docs/algorithms.md
    11.1), and only they keep what they observe. Every other rule keeps the neutral answers of ServerRule."""
    # Prepare
    rule, fresh = build_strategy(name), build_strategy(name)
    # Execute
    asked = [rule.round_requirements(r) for r in range(1, 25)]
    rule.observe_round(1, STATS)
    # Assert
    if name in ("adafed", "d-adafed", "f-adafed"):
        assert sum(a.feature_stats is not None for a in asked) == 1
        assert rule.state_dict()["sites"] == list(SITES)
    else:
        assert asked == [RoundRequirements()] * len(asked)
        assert rule.state_dict() == fresh.state_dict()
