"""FedFBN's surgical output layer from a secure sum: each site masks row r of the output layer times 1 if it
annotates label r (else 0) and those K zeros and ones (fedmqtt/secagg/weighted.py); the PS reads each row's mean
over the sites that annotate its label, as the clear rule (`surgical_aggregate`) gives, within the ring's bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError
from secagg_round import Losses, federation, play, site_ids

from fedmqtt.secagg import messages as msg
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.weighted import (
    label_sums_from_sum,
    layout_of,
    mean_error_bound,
    mean_from_sum,
    split,
    weighted_vector,
)
from fedmqtt.strategies import build_strategy
from fedmqtt.strategies.base import Manifest, RoundInput, SiteUpdate, TensorSpec, Weights
from fedmqtt.strategies.fedfbn import FedFBN
from fedmqtt.strategies.sums import LabelSums, aggregate_from_label_sums
from ps_daemon import effects as fx
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SecAggReceived, SiteOnline, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights
from ps_daemon.secure_round import label_rows
from schemas.codec import decode, encode
from schemas.secagg import SecAggInbox, SecAggRoster, SecAggTerms
from site_agent.label_set import annotated_labels
from site_agent.secagg_round import SiteRound
from site_agent.secagg_store import SecAggStore

FIXED = FixedPoint(clip=4.0, fraction_bits=20, bits=64, max_sites=8)
LABELS = ("L0", "L1", "L2", "L3")  # row r of the output layer is label r; nobody annotates L3
MASKS = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 1, 0, 0]], dtype=np.float64)


def _trip(message: object) -> Any:
    return decode(encode(message))


def _model(rng: np.random.Generator) -> tuple[Weights, Manifest]:
    model = {"body.weight": rng.normal(size=(5, 3)).astype(np.float32),
             "fc.weight": rng.normal(size=(4, 5)).astype(np.float32), "fc.bias": rng.normal(size=4).astype(np.float32),
             "bn.weight": np.ones(5, np.float32), "bn.num_batches_tracked": np.array(2, dtype=np.int64)}
    tags = {"body.weight": {"TRAIN"}, "fc.weight": {"TRAIN", "HEAD"}, "fc.bias": {"TRAIN", "HEAD"},
            "bn.weight": {"TRAIN", "NORM:BatchNorm1d"}, "bn.num_batches_tracked": {"NORM:BatchNorm1d"}}
    return model, {n: TensorSpec(n, tuple(np.shape(v)), str(v.dtype), frozenset(tags[n])) for n, v in model.items()}


def test_surgical_rows_from_label_sums_equal_the_clear_rule_with_a_dropout() -> None:
    """Five sites, one lost after sharing its keys: the body is the plain mean of the four that remain, each
    output row the mean over the remaining sites that annotate its label (the clear rule on their own rows),
    and the label nobody annotates keeps its current rows exactly."""
    rng = np.random.default_rng(11)
    current, manifest = _model(rng)
    secure_rule, clear_rule = build_strategy("fedfbn", {}), build_strategy("fedfbn", {})
    shared = {k: current[k] for k in secure_rule.shared_names(manifest)}
    floats = split(shared)[0]
    rows = label_rows(secure_rule, manifest, floats)
    assert rows == ("fc.bias", "fc.weight")
    layout = layout_of(floats, rows=rows)
    assert layout.labels == 4 and layout.length == sum(v.size for v in floats.values()) + 1 + 4
    names = site_ids(5)
    masks = dict(zip(names, MASKS, strict=True))
    trained = {s: {k: v + rng.normal(scale=0.4, size=v.shape).astype(v.dtype) for k, v in floats.items()}
               for s in names}
    bound_b = 5.0  # the plain mean: B = the selected sites, p_i = 1 / B
    vectors = {s: weighted_vector(trained[s], layout, 1, bound_b, label_mask=masks[s]) for s in names}
    played = play(5, layout.length, fixed=FIXED, updates=vectors, losses=Losses(before_masked={names[2]}))
    assert isinstance(played.outcome, msg.RoundSum), played.outcome
    included = sorted(played.outcome.included)
    assert names[2] not in included and len(included) == 4

    mean, count = mean_from_sum(played.outcome.total, layout, bound_b)
    mean.update(split(shared)[1])
    weight, summed = label_sums_from_sum(played.outcome.total, layout)
    holders = np.rint(weight * bound_b).astype(np.int64)
    assert count == 4 and holders.tolist() == MASKS[[names.index(s) for s in included]].sum(axis=0).tolist()
    inp = RoundInput(1, dict(shared), [], {s: 10 for s in names}, manifest)
    secure = aggregate_from_label_sums(secure_rule, inp, mean, count, LabelSums(weight, holders, summed)).weights

    clear = clear_rule.aggregate_train(RoundInput(1, dict(shared), [
        SiteUpdate(s, trained[s], 10, 1, extras={"label_set": tuple(np.flatnonzero(masks[s]))}) for s in included],
        {}, manifest))
    largest = max(float(np.max(np.abs(trained[s][k]))) for s in included for k in floats)
    cast = largest * 2.0**-23  # the float32 cast of the mean
    body_bound = mean_error_bound(FIXED, 4, count / bound_b, largest) + cast
    body_error = np.max(np.abs(secure["body.weight"].astype(np.float64) - clear.weights["body.weight"]))
    assert body_error <= body_bound < 1e-4
    for r, label in enumerate(LABELS):
        for name in rows:
            got = secure[name][r].astype(np.float64)
            if not holders[r]:  # nobody annotates it: the current rows, untouched (the clear rule keeps them too)
                assert str(r) not in clear_rule.label_rows
                assert np.array_equal(secure[name][r], shared[name][r])
                assert np.array_equal(clear.weights[name][r], shared[name][r])
                continue
            row_bound = mean_error_bound(FIXED, 4, holders[r] / bound_b, largest) + cast
            assert np.max(np.abs(got - clear.weights[name][r])) <= row_bound, (label, name)
            everyone = np.mean([trained[s][name][r] for s in included], axis=0)  # the comparison can fail
            if holders[r] < 4:
                assert np.max(np.abs(got - everyone)) > 100 * row_bound, (label, name)


def test_the_masked_vector_refuses_a_bad_label_mask_and_ragged_rows() -> None:
    rng = np.random.default_rng(2)
    current, manifest = _model(rng)
    floats = split({k: current[k] for k in ("body.weight", "fc.weight", "fc.bias")})[0]
    layout = layout_of(floats, rows=("fc.weight", "fc.bias"))
    for mask in (None, [1, 0, 1], [1, 0, 0.5, 1], [1, 0, np.nan, 1]):
        with pytest.raises(ValueError, match="label mask"):
            weighted_vector(floats, layout, 1, 3.0, label_mask=mask)
    with pytest.raises(ValueError, match="one row per label"):
        layout_of(floats, rows=("fc.weight", "body.weight"))
    with pytest.raises(ValueError, match="not float tensors"):
        layout_of(floats, rows=("bn.num_batches_tracked",))
    with pytest.raises(ValueError, match="plain tensors"):
        layout_of(floats, rows=("fc.bias",), variates=True)
    assert label_rows(build_strategy("fedfbn", {"partial_labels": "masked_loss"}), manifest, floats) == ()
    assert label_rows(build_strategy("fedavg", {}), manifest, floats) == ()


def test_terms_carry_label_rows_only_with_the_plain_mean() -> None:
    base = {"ring_bits": 64, "fraction_bits": 20, "clip": 4.0, "max_sites": 5, "dropout": 0.1}
    assert SecAggTerms(**base, uniform=True, per_label_tensors=("fc.bias",)).per_label_tensors == ("fc.bias",)
    for other in ({}, {"uniform": True, "variates": True}):
        with pytest.raises(ValidationError, match="per_label_tensors go only with the plain mean"):
            SecAggTerms(**base, **other, per_label_tensors=("fc.bias",))


def test_a_site_annotates_the_labels_its_records_do_not_leave_as_nan() -> None:
    y = np.array([[1, np.nan, 0], [0, np.nan, np.nan]], dtype=np.float32)
    assert annotated_labels("multilabel", y, 3).tolist() == [1.0, 0.0, 1.0]
    assert annotated_labels("multiclass", np.array([0, 2]), 3).tolist() == [1.0, 1.0, 1.0]


def test_a_surgical_round_through_the_ps_machine(tmp_path: Path) -> None:
    """The PS's pure machine with FedFBN (surgical, the default) and four sites played by the site driver over the
    wire kinds: the tasks name the output tensors, each site masks by its labels, and the round's model has each
    output row as the clear rule's mean over the sites that annotate it (within 1e-4), the body the plain mean."""
    run, sites = "secagg-surgical", tuple(site_ids(4))
    config = DaemonConfig.model_validate({
        "run_id": run, "sites": list(sites), "rounds": 2, "quorum": 1, "round_timeout_s": 100.0,
        "model": {"name": "mlp", "args": {}}, "credentials": "creds.toml", "algorithm": "fedfbn",
        "secure_aggregation": {"enabled": True, "stage_timeout_s": 10.0, "fraction_bits": 20, "clip": 4.0}})
    keys = federation(run, 4)
    machine = Machine(config, FedFBN(), hash_weights, verifier=keys.identity("observer").ring)
    rng = np.random.default_rng(5)
    weights, manifest = _model(rng)
    weights = {k: weights[k] for k in ("body.weight", "fc.weight", "fc.bias")}
    manifest = {k: manifest[k] for k in weights}
    masks = dict(zip(sites, MASKS[:4], strict=True))
    trained = {s: {k: v + rng.normal(scale=0.4, size=v.shape).astype(v.dtype) for k, v in weights.items()}
               for s in sites}
    state = machine.initial_state(weights, manifest, session="ab12")
    effects: list[fx.Effect] = []
    for s in sites:
        state, effects = machine.step(state, SiteOnline(s, now=0.0, n_train=50))
    tasks = {e.site_id: e.secure for e in effects if isinstance(e, fx.PublishTrainTask)}
    assert set(tasks) == set(sites) and all(t is not None and t.per_label_tensors == ("fc.bias", "fc.weight")
                                            for t in tasks.values())
    drivers: dict[str, SiteRound] = {}
    for s in sites:
        terms = tasks[s]
        assert terms is not None
        layout = layout_of(split(machine.shared_model(state))[0], rows=terms.per_label_tensors)
        drivers[s] = SiteRound(SecAggStore(tmp_path / s), keys.identity(s), run_id=run, session=state.session,
                               round_no=state.round, terms=terms, layout=layout, label_mask=masks[s])
        state, effects = machine.step(state, UpdateReceived(s, 1.0, state.round, state.model_hash,
                                                            SiteUpdate(s, {}, 50, 3), 0.3, {"auroc": 0.7}))
        state, effects = machine.step(state, SecAggReceived(s, 1.0, state.round, _trip(drivers[s].advert())))
    for _ in range(3):  # shares, masked inputs, unmasking answers
        out = effects
        for e in [e for e in out if isinstance(e, fx.PublishSecAgg)]:
            message, site = _trip(e.message), drivers[e.site_id]
            if isinstance(message, SecAggRoster):
                reply: object = site.on_roster(message)
            elif isinstance(message, SecAggInbox):
                reply = site.on_inbox(message, trained[e.site_id], 50)
            else:
                reply = site.on_unmask(message)
            state, effects = machine.step(state, SecAggReceived(e.site_id, 2.0, state.round, _trip(reply)))
    assert state.round == 2 and state.history[-1].sites == sites

    clear_rule = FedFBN()
    clear = clear_rule.aggregate_train(RoundInput(1, dict(weights), [SiteUpdate(
        s, trained[s], 50, 1, extras={"label_set": tuple(np.flatnonzero(masks[s]))}) for s in sites], {}, manifest))
    assert np.max(np.abs(state.weights["body.weight"] - clear.weights["body.weight"])) <= 1e-4
    for r in range(len(LABELS)):
        for name in ("fc.weight", "fc.bias"):
            if str(r) not in clear_rule.label_rows:
                assert np.array_equal(state.weights[name][r], weights[name][r])
            assert np.max(np.abs(state.weights[name][r] - clear.weights[name][r])) <= 1e-4
