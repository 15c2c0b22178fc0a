"""FedFBN's surgical output layer in the clear: the task names the output tensors averaged label by label, each
site's update names the labels it annotates (`label_set`), and the PS checks that set like any other field
(schema, bounded length, rows within the model's output layer) before it is stored or used."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fedmqtt.errors import SchemaError
from fedmqtt.strategies import build_strategy
from fedmqtt.strategies.base import TensorSpec
from ps_daemon import effects as fx
from ps_daemon.admission import update_rejection
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SiteOnline
from ps_daemon.inbound import _update_extras
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights
from ps_daemon.refusals import refusal_category
from schemas import messages as m
from schemas.codec import decode, encode
from schemas.secagg import SecAggTerms
from schemas.tensors import arrays_to_blobs
from site_agent.label_set import label_set_for

SITES = ("site-a", "site-b")
LABELS = 4  # the output layer's rows
WEIGHTS = {"body.weight": np.zeros((3, 2), np.float32), "head.weight": np.zeros((LABELS, 3), np.float32),
           "head.bias": np.zeros(LABELS, np.float32)}
MANIFEST = {"body.weight": TensorSpec("body.weight", (3, 2), "float32", frozenset({"TRAIN"})),
            "head.weight": TensorSpec("head.weight", (LABELS, 3), "float32", frozenset({"TRAIN", "HEAD"})),
            "head.bias": TensorSpec("head.bias", (LABELS,), "float32", frozenset({"TRAIN", "HEAD"}))}
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _open_round(algorithm: str = "fedfbn", params: dict[str, Any] | None = None) -> tuple[Machine, Any, list[Any]]:
    """`params`: the rule's own (FedFBN's partial_labels is a string, which the PS config's `hyper` cannot hold)."""
    config = DaemonConfig.model_validate({"run_id": "r1", "sites": list(SITES), "model": {"name": "mlp"},
                                          "credentials": "c.toml", "algorithm": algorithm})
    machine = Machine(config, build_strategy(algorithm, params or {}), hash_weights)
    state = machine.initial_state(dict(WEIGHTS), MANIFEST, session="5e55")
    effects: list[Any] = []
    for site in SITES:
        state, effects = machine.step(state, SiteOnline(site, now=0.0))
    assert state.phase == "training" and state.round == 1
    return machine, state, effects


def _update(state: Any, **changes: Any) -> m.ClientUpdate:
    fields: dict[str, Any] = dict(run_id="r1", sender="site-a", round=state.round, session=state.session,
                                  base_model_hash=state.model_hash, tensors=arrays_to_blobs(WEIGHTS),
                                  n_samples=10, local_steps=2)
    return m.ClientUpdate(**{**fields, **changes})


def test_a_surgical_task_names_the_output_tensors_and_another_rule_none() -> None:
    _, _, effects = _open_round()
    tasks = [e for e in effects if isinstance(e, fx.PublishTrainTask)]
    assert len(tasks) == 2 and all(t.per_label == ("head.bias", "head.weight") for t in tasks)
    for algorithm, params in (("fedfbn", {"partial_labels": "masked_loss"}), ("fedavg", {})):
        _, _, effects = _open_round(algorithm, params)
        assert all(e.per_label == () for e in effects if isinstance(e, fx.PublishTrainTask))


def test_the_ps_takes_a_label_set_within_the_output_layer() -> None:
    machine, state, _ = _open_round()
    for labels in ((), (0,), (1, 3), (0, 1, 2, 3)):
        update = _update(state, label_set=labels)
        assert update_rejection(machine, state, "site-a", update) is None, labels
        assert _update_extras(decode(encode(update)))["label_set"] == labels  # stored with the update as sent


@pytest.mark.parametrize(("algorithm", "params", "label_set", "needle"), [
    ("fedfbn", {}, None, "names none"),
    ("fedfbn", {}, (0, 4), "names row 4, but the output layer has 4 labels"),
    ("fedfbn", {}, (99_999,), "names row 99999"),
    ("fedfbn", {"partial_labels": "masked_loss"}, (0,), "averages no output rows label by label"),
    ("fedavg", {}, (0, 1), "averages no output rows label by label"),
])
def test_a_missing_or_unasked_for_label_set_is_refused_with_a_reason(algorithm: str, params: dict[str, Any],
                                                                     label_set: tuple[int, ...] | None,
                                                                     needle: str) -> None:
    machine, state, _ = _open_round(algorithm, params)
    reason = update_rejection(machine, state, "site-a", _update(state, label_set=label_set))
    assert reason is not None and needle in reason
    assert refusal_category(reason) == "label set"  # counted under its own key in ps/status


@pytest.mark.parametrize("label_set", [(1, 1), (2, 1), (-1,), (100_000,), tuple(range(100_001)), ("0",), (0.5,),
                                       (True,)])
def test_the_schema_refuses_a_label_set_that_is_not_increasing_row_indices(label_set: tuple[Any, ...]) -> None:
    fields = _update(_open_round()[1]).model_dump()
    with pytest.raises(ValidationError):
        m.ClientUpdate.model_validate({**fields, "label_set": label_set})


def test_an_answer_without_a_step_names_no_label_set_and_a_secure_task_no_clear_rows() -> None:
    fields = _update(_open_round()[1]).model_dump()
    with pytest.raises(ValidationError, match="label set"):
        m.ClientUpdate.model_validate({**fields, "tensors": (), "local_steps": 0, "no_step_reason": "one row",
                                       "label_set": (0,)})
    task = dict(run_id="r1", sender="ps", round=1, site_id="site-a", model_hash="h" * 64, deadline=1.0,
                settings=m.TrainSettings(), per_label_tensors=("head.weight",))
    assert m.TrainTask(**task).per_label_tensors == ("head.weight",)
    with pytest.raises(ValidationError, match="only in the clear"):
        m.TrainTask(**task, secure_aggregation=SecAggTerms(ring_bits=64, fraction_bits=20, clip=4.0, max_sites=4,
                                                           dropout=0.1, uniform=True))


@FUZZ
@given(label_set=st.one_of(st.none(), st.lists(st.one_of(st.integers(-3, 2**40), st.booleans(), st.floats(),
                                                            st.text(max_size=3)), max_size=12)))
def test_any_label_set_on_the_wire_is_refused_or_fits_the_model(label_set: list[Any] | None) -> None:
    """Whatever a site puts in label_set, decoding refuses it (SchemaError) or the PS's admission either refuses
    it with a reason or takes a set of distinct, increasing rows of the output layer; nothing raises."""
    machine, state, _ = _open_round()
    raw = {**_update(state).model_dump(), "label_set": label_set}
    import msgpack

    try:
        update = decode(msgpack.packb(raw, use_bin_type=True))
    except SchemaError:
        return
    assert isinstance(update, m.ClientUpdate)
    reason = update_rejection(machine, state, "site-a", update)
    if reason is None:
        rows = list(update.label_set or ())
        assert update.label_set is not None and rows == sorted(set(rows)) and all(0 <= r < LABELS for r in rows)
    else:
        assert refusal_category(reason) == "label set"


def test_the_site_derives_its_label_set_from_the_labels_its_data_annotate() -> None:
    """Multi-label data mark a label the site does not annotate with NaN in every record; other tasks annotate
    every output row. No label set without per_label tensors, nor for tensors the model lacks."""
    y = np.array([[1.0, np.nan, 0.0, np.nan], [0.0, np.nan, np.nan, np.nan]])
    assert label_set_for(("head.weight", "head.bias"), WEIGHTS, "multilabel", y) == (0, 2)
    assert label_set_for(("head.weight",), WEIGHTS, "multilabel", np.full((3, LABELS), np.nan)) == ()
    assert label_set_for(("head.weight",), WEIGHTS, "multiclass", np.array([0, 3])) == (0, 1, 2, 3)
    assert label_set_for((), WEIGHTS, "multilabel", y) is None
    assert label_set_for(("missing",), WEIGHTS, "multilabel", y) is None
    assert label_set_for(("head.weight", "body.weight"), WEIGHTS, "multilabel", y) is None  # rows disagree
