"""What the PS takes from a site, judged against the open round before anything is stored (ps_daemon/admission.py)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from fedmqtt.strategies import build_strategy
from ps_daemon.admission import histogram_rejection, manifest_rejection, report_rejection, update_rejection
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SiteOnline
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights
from schemas import messages as m
from schemas.chunks import ChunkManifest, TensorEntry, root_digest
from schemas.tensors import TensorBlob, arrays_to_blobs

SITES = ("site-a", "site-b")
WEIGHTS = {"fc.weight": np.zeros((2, 3), np.float32), "fc.bias": np.zeros(2, np.float32),
           "bn.num_batches_tracked": np.array(0, np.int64)}


def _open_round(algorithm: str = "fedavg") -> tuple[Machine, Any]:
    config = DaemonConfig.model_validate({"run_id": "r1", "sites": list(SITES), "model": {"name": "mlp"},
                                          "credentials": "c.toml", "algorithm": algorithm,
                                          "train": {"optimizer": "sgd"}})
    machine = Machine(config, build_strategy(algorithm, config.strategy_params()), hash_weights)
    state = machine.initial_state(dict(WEIGHTS), session="5e55")
    for site in SITES:
        state, _ = machine.step(state, SiteOnline(site, now=0.0))
    assert state.phase == "training" and state.round == 1
    return machine, state


def _update(state: Any, **changes: Any) -> m.ClientUpdate:
    fields: dict[str, Any] = dict(run_id="r1", sender="site-a", round=state.round, session=state.session,
                                  base_model_hash=state.model_hash, tensors=arrays_to_blobs(WEIGHTS),
                                  n_samples=10, local_steps=2)
    return m.ClientUpdate(**{**fields, **changes})


def test_a_fitting_update_is_admitted() -> None:
    machine, state = _open_round()
    assert update_rejection(machine, state, "site-a", _update(state)) is None


@pytest.mark.parametrize(("changes", "needle"), [
    ({"round": 2}, "stale or future round"),
    ({"round": 2**20}, "stale or future round"),
    ({"base_model_hash": "f" * 64}, "different model version"),
    ({"session": "01d"}, "answers session"),
    ({"n_samples": 0}, "at least one training sample"),
    ({"local_steps": 0}, "at least one training sample"),
    ({"tensors": arrays_to_blobs({**WEIGHTS, "fc.bias": np.zeros(3, np.float32)})}, "the model has float32[2]"),
    ({"tensors": arrays_to_blobs({**WEIGHTS, "fc.bias": np.zeros(2, np.float64)})}, "is float64[2]"),
    ({"tensors": arrays_to_blobs({k: v for k, v in WEIGHTS.items() if k != "fc.bias"})}, "missing ['fc.bias']"),
    ({"tensors": arrays_to_blobs({**WEIGHTS, "x": np.zeros(1, np.float32)})}, "unexpected ['x']"),
    ({"tensors": (*arrays_to_blobs({k: v for k, v in WEIGHTS.items() if k != "fc.bias"}),
                  TensorBlob(name="fc.bias", dtype="bfloat16", shape=(2,), data=b"\x00\x00" * 2))}, "is bfloat16[2]"),
    ({"control_variates": arrays_to_blobs({"fc.bias": np.zeros(2, np.float32)})}, "takes none"),
    ({"scalars": {"a_norm": 0.0}}, "a_norm"),
    ({"label_histogram": {"0": 3, "x": 1}}, "not a class index"),
    ({"layer_stats": arrays_to_blobs({"l1/mean": np.zeros(2)})}, "needs a mean and a var"),
])
def test_an_update_that_does_not_fit_the_open_round_is_refused(changes: dict[str, Any], needle: str) -> None:
    machine, state = _open_round()
    reason = update_rejection(machine, state, "site-a", _update(state, **changes))
    assert reason is not None and needle in reason


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_a_site_that_could_not_take_a_step_is_heard_without_tensors(algorithm: str) -> None:
    """An answer with no_step_reason carries no tensors (nor SCAFFOLD's control variates) and is admitted; a
    zero-step update without a reason is still refused, naming the field that says why."""
    machine, state = _open_round(algorithm)
    answer = _update(state, tensors=(), n_samples=1, local_steps=0, no_step_reason="1 labelled training row")
    assert update_rejection(machine, state, "site-a", answer) is None
    assert "no_step_reason" in update_rejection(machine, state, "site-a", _update(state, local_steps=0))
    stale = answer.model_copy(update={"round": 2})
    assert "stale or future round" in update_rejection(machine, state, "site-a", stale)


def test_first_update_wins_and_unselected_sites_are_refused() -> None:
    machine, state = _open_round()
    from fedmqtt.strategies import SiteUpdate
    from ps_daemon.events import UpdateReceived

    state, _ = machine.step(state, UpdateReceived("site-a", 1.0, 1, state.model_hash,
                                                  SiteUpdate("site-a", dict(WEIGHTS), 10, 2)))
    assert "duplicate update" in update_rejection(machine, state, "site-a", _update(state))
    assert "not selected" in update_rejection(machine, state, "site-z", _update(state, sender="site-z"))


def test_scaffold_needs_control_variates_that_fit_the_model() -> None:
    machine, state = _open_round("scaffold")
    assert "needs control variates" in update_rejection(machine, state, "site-a", _update(state))
    bad = arrays_to_blobs({"fc.bias": np.zeros(5, np.float32)})
    assert "control variates" in update_rejection(machine, state, "site-a", _update(state, control_variates=bad))
    good = arrays_to_blobs({"fc.weight": np.zeros((2, 3), np.float32), "fc.bias": np.zeros(2, np.float32)})
    assert update_rejection(machine, state, "site-a", _update(state, control_variates=good)) is None


def test_histogram_bins_are_class_indices() -> None:
    assert histogram_rejection({"0": 4, "1": 0}) is None
    assert histogram_rejection({"1" * 40: 1}) is not None
    assert histogram_rejection({"0": -1}) is not None


def _manifest(state: Any, *, total: int, entries: tuple[TensorEntry, ...], round_no: int = 1) -> ChunkManifest:
    chunk = min(8 * 1024 * 1024, max(1024, total // 128))
    digests = tuple(hashlib.sha256(str(i).encode()).hexdigest() for i in range(-(-total // chunk)))
    return ChunkManifest(run_id="r1", sender="site-a", round=round_no, inner_kind="client_update",
                         transfer_id="t" * 16, total_bytes=total, chunk_bytes=chunk, chunk_sha256=digests,
                         root_sha256=root_digest(digests), tensor_index=entries)


def test_a_chunked_update_is_judged_before_any_chunk_is_fetched() -> None:
    machine, state = _open_round()
    entries = tuple(TensorEntry(name=n, dtype=str(v.dtype), shape=v.shape) for n, v in sorted(WEIGHTS.items()))
    assert manifest_rejection(machine, state, "site-a", "update", _manifest(state, total=4096, entries=entries)) is None
    huge = _manifest(state, total=1 << 30, entries=entries)
    assert "needs at most" in manifest_rejection(machine, state, "site-a", "update", huge)
    wrong = entries[:-1]
    assert "missing" in manifest_rejection(machine, state, "site-a", "update", _manifest(state, total=4096,
                                                                                         entries=wrong))
    far = _manifest(state, total=4096, entries=entries, round_no=99)
    assert "stale or future round" in manifest_rejection(machine, state, "site-a", "update", far)
    assert "PS" in manifest_rejection(machine, state, None, "model", far)


def test_reports_are_taken_only_for_the_final_model_and_once() -> None:
    machine, state = _open_round()
    report = m.EvalReport(run_id="r1", sender="site-a", round=state.round, session=state.session,
                          model_hash=state.model_hash, tag="final", metrics={}, n_samples={})
    assert "stale or future round" in report_rejection(state, "site-a", report)  # still training
