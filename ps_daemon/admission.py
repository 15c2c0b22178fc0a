"""What the PS accepts from a site, judged against the open round before anything is stored or acted on.

The schemas already guarantee a well-formed message (sizes, dtypes, finite numbers, sender = topic owner). This
module adds what only the PS knows: the open round, who was selected, what was already accepted (first wins), and
the model every update must match by tensor name, dtype and shape. Pure functions: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ps_daemon.machine import Machine
from ps_daemon.state import DaemonState
from schemas.chunks import ChunkManifest
from schemas.messages import ROUND_VALIDATION_TAG, ClientUpdate, EvalReport, RecordDP
from schemas.tensors import TensorBlob

# FedNova divides by ||a_i||_1, which is >= 1 for any real local run (one or more SGD steps): a tiny or huge value
# is not a training result, and would blow up the aggregate.
A_NORM_RANGE = (1e-3, 1e9)
# A histogram bin is a class index; far more bins than any classifier has is not a label histogram.
MAX_HISTOGRAM_BINS = 100_000
# A chunked update may carry the model, SCAFFOLD's control variates and AdaFed's layer statistics.
CHUNKED_UPDATE_SLACK_BYTES = 16 * 1024 * 1024


def model_layout(weights: dict[str, np.ndarray]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (wire dtype, shape) of the tensors an update must carry."""
    return {n: (np.asarray(v).dtype.name, tuple(int(d) for d in np.shape(v))) for n, v in weights.items()}


def _layout_mismatch(entries: Sequence[tuple[str, str, tuple[int, ...]]],
                     layout: Mapping[str, tuple[str, tuple[int, ...]]], what: str, *, complete: bool) -> str | None:
    names = [name for name, _, _ in entries]
    if len(set(names)) != len(names):
        return f"{what}: a tensor name appears twice"
    extra = sorted(set(names) - set(layout))
    missing = sorted(set(layout) - set(names)) if complete else []
    if extra or missing:
        return f"{what}: tensor names differ from the global model (missing {missing[:3]}, unexpected {extra[:3]})"
    for name, dtype, shape in entries:
        want_dtype, want_shape = layout[name]
        if dtype != want_dtype or tuple(shape) != want_shape:
            return (f"{what}: tensor {name[:64]!r} is {dtype}{list(shape)[:8]}, "
                    f"the model has {want_dtype}{list(want_shape)}")
    return None


def _blob_entries(blobs: tuple[TensorBlob, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(b.name, b.dtype, tuple(b.shape)) for b in blobs]


def update_rejection(machine: Machine, state: DaemonState, site: str, msg: ClientUpdate) -> str | None:
    """Why `msg` from `site` cannot be accepted into the open round (None: accept it)."""
    reason = machine.admit_update(state, site, msg.round, msg.base_model_hash)
    if reason is not None:
        return reason
    if msg.session != state.session:
        return f"answers session {msg.session[:16]!r}, not this start of the run ({state.session})"
    if msg.no_step_reason:  # the site could not train: an answer without tensors (the schema checked it has none)
        return None if msg.label_histogram is None else histogram_rejection(msg.label_histogram)
    if machine.secure_on:
        reason = secure_update_rejection(msg) or _privacy_rejection(machine.config.train.dp, msg)
        if reason is None and msg.label_histogram is not None:
            return histogram_rejection(msg.label_histogram)
        return reason
    layout = model_layout(machine.shared_model(state))
    reason = _layout_mismatch(_blob_entries(msg.tensors), layout, "tensors", complete=True)
    if reason is not None:
        return reason
    if msg.n_samples < 1 or msg.local_steps < 1:
        return (f"an update needs at least one training sample and one local step (got {msg.n_samples}, "
                f"{msg.local_steps}); a site that cannot take a step says why in no_step_reason")
    takes_cv = "delta_c" in getattr(machine.strategy, "uplink_extras", ())
    if msg.control_variates and not takes_cv:
        return f"control variates sent, but the run's algorithm {machine.strategy.name!r} takes none"
    if takes_cv:
        if not msg.control_variates:
            return f"{machine.strategy.name} needs control variates with every update"
        # Control variates are float32 whatever the model's float type: compare names and shapes only.
        full = {n: ("float", shape) for n, (_, shape) in model_layout(dict(state.weights)).items()}
        entries = [(b.name, "float" if b.dtype.startswith("float") else b.dtype, tuple(b.shape))
                   for b in msg.control_variates]
        reason = _layout_mismatch(entries, full, "control variates", complete=False)
        if reason is not None:
            return reason
    if msg.layer_stats:
        reason = _layer_stats_rejection(msg.layer_stats)
        if reason is not None:
            return reason
    reason = label_set_rejection(machine.clear_label_rows(state), layout, machine.strategy.name, msg.label_set)
    if reason is not None:
        return reason
    a_norm = msg.scalars.get("a_norm")
    if a_norm is not None and not A_NORM_RANGE[0] <= a_norm <= A_NORM_RANGE[1]:
        return f"scalar a_norm {a_norm:.3g} is outside {A_NORM_RANGE}"
    reason = _privacy_rejection(machine.config.train.dp, msg)
    if reason is not None:
        return reason
    if msg.label_histogram is not None:
        return histogram_rejection(msg.label_histogram)
    return None


def label_set_rejection(per_label: Sequence[str], layout: Mapping[str, tuple[str, tuple[int, ...]]], rule: str,
                        label_set: Sequence[int] | None) -> str | None:
    """An update's label set (the output rows its site annotates) against what the run asked for: required when
    the task named `per_label` tensors (FedFBN surgical, in the clear), then rows of those tensors in `layout`;
    refused when it did not (the run has no use for which labels a site holds, so it is not to be told)."""
    if not per_label:
        return None if label_set is None else f"names a label set, but the run's algorithm {rule!r} averages no " \
                                               "output rows label by label"
    if label_set is None:
        return (f"{rule} averages the output layer label by label (partial_labels = \"surgical\"): every update "
                f"names its label set, the labels its site annotates; this one names none (a site agent too old "
                f"for this run?)")
    labels = min(layout[name][1][0] for name in per_label)
    outside = [r for r in label_set if r >= labels]
    if outside:
        return f"label set names row {outside[0]}, but the output layer has {labels} labels"
    return None


def _privacy_rejection(dp: RecordDP | None, msg: ClientUpdate) -> str | None:
    """Under record-level DP every update says what it spent, at the run's delta (the PS cannot check the noise
    itself; a site that trained without DP would otherwise pass unnoticed). Without DP it says nothing."""
    if dp is None:
        return None if msg.privacy is None else "reports record-level DP spending, but the run trains without DP"
    if msg.privacy is None:
        return "the run trains with record-level DP, and this update does not say what it spent"
    if msg.privacy.delta != dp.delta or msg.privacy.accountant != dp.accountant:
        return (f"reports epsilon at delta {msg.privacy.delta:g} ({msg.privacy.accountant}), not the run's "
                f"{dp.delta:g} ({dp.accountant})")
    return None


def report_rejection(state: DaemonState, site: str, msg: EvalReport,
                     validators: Sequence[str] = ()) -> str | None:
    """Why an evaluation report cannot be taken (None: take it). First wins, like updates. `validators`: the
    sites asked to validate the open round's model (evaluation = "all"; Machine.validation_sites)."""
    if msg.tag == ROUND_VALIDATION_TAG:
        return _validation_rejection(state, site, msg, validators)
    if state.phase != "evaluating" or msg.round != state.round:
        return f"stale or future round (PS is in {state.phase} round {state.round})"
    if msg.tag != "final":
        return f"report tag {msg.tag[:32]!r} was not asked for"
    if site not in state.selected:
        return "site was not asked to evaluate"
    if site in state.final_reports:
        return "duplicate report (the first one was taken)"
    return _model_or_session_rejection(state, msg)


def _validation_rejection(state: DaemonState, site: str, msg: EvalReport, validators: Sequence[str]) -> str | None:
    """A site's validation of the open round's model (evaluation = "all"): asked of it, of this round, model and
    start, once, with the val split's metrics only (the schema has checked that every value is finite)."""
    if state.phase != "training" or msg.round != state.round:
        return f"stale or future round (PS is in {state.phase} round {state.round})"
    if site not in validators:
        return "site was not asked to validate this round's model"
    if site in state.validated:
        return "duplicate report (the first one was taken)"
    if (why := _model_or_session_rejection(state, msg)) is not None:
        return why
    if set(msg.metrics) != {"val"}:
        return f"round validation must carry the val split's metrics only, not {sorted(msg.metrics)[:4]}"
    return None


def _layer_stats_rejection(blobs: tuple[TensorBlob, ...]) -> str | None:
    by_name = {b.name: b for b in blobs}
    if len(by_name) != len(blobs):
        return "layer statistics: a name appears twice"
    for name, blob in by_name.items():
        layer, _, what = name.rpartition("/")
        if not layer or what not in ("mean", "var"):
            return f"layer statistics: {name[:64]!r} is not '<layer>/mean' or '<layer>/var'"
        if blob.dtype not in ("float32", "float64"):
            return f"layer statistics: {name[:64]!r} is {blob.dtype}, expected a float"
        twin = by_name.get(f"{layer}/{'var' if what == 'mean' else 'mean'}")
        if twin is None or twin.shape != blob.shape:
            return f"layer statistics: {layer[:64]!r} needs a mean and a var of the same shape"
    return None


def histogram_rejection(hist: dict[str, int]) -> str | None:
    """A label histogram's bins are class indices "0", "1", ... with non-negative counts."""
    if len(hist) > MAX_HISTOGRAM_BINS:
        return f"label histogram with {len(hist)} bins"
    for key, count in hist.items():
        if not (key.isdigit() and len(key) <= 6) or count < 0:
            return f"label histogram bin {key[:16]!r}: {count} is not a class index with a non-negative count"
    return None


def manifest_rejection(machine: Machine, state: DaemonState, site: str | None, kind: str,
                       manifest: ChunkManifest) -> str | None:
    """Refuse a chunked transfer before a single chunk is fetched: wrong round or sender, a layout that cannot
    match the model, or more bytes than such a message can need."""
    if site is None:
        return "chunked messages from the PS are not expected here"
    if kind == "update" and manifest.inner_kind == "secagg_masked":
        return masked_manifest_rejection(machine, state, site, manifest)
    if kind == "update":
        if manifest.inner_kind != "client_update":
            return f"a {manifest.inner_kind[:32]} cannot travel on an update topic"
        reason = machine.admit_update(state, site, manifest.round, state.model_hash)
        if reason is not None:
            return reason
        layout = model_layout(machine.shared_model(state))
        entries = [(t.name, t.dtype, tuple(t.shape)) for t in manifest.tensor_index]
        reason = _layout_mismatch(entries, layout, "chunked update", complete=True)
        if reason is not None:
            return reason
        model_bytes = sum(np.asarray(v).nbytes for v in state.weights.values())
        budget = 2 * model_bytes + CHUNKED_UPDATE_SLACK_BYTES  # tensors + control variates + statistics
        if manifest.total_bytes > budget:
            return f"chunked update of {manifest.total_bytes} bytes; an update of this model needs at most {budget}"
        return None
    if kind == "report":
        asked = state.selected if state.phase == "evaluating" else machine.validation_sites(state)
        if state.phase not in ("evaluating", "training") or manifest.round != state.round or site not in asked:
            return f"no report is expected now (PS is in {state.phase} round {state.round})"
        if manifest.total_bytes > CHUNKED_UPDATE_SLACK_BYTES:
            return f"chunked report of {manifest.total_bytes} bytes"
        return None
    return f"a chunked {kind} is not expected from a site"


def masked_manifest_rejection(machine: Machine, state: DaemonState, site: str, manifest: ChunkManifest) -> str | None:
    """A chunked masked input: only in the masked-input stage of the open try, from a site it waits for, one flat
    ring vector of the model's float coordinates plus one (the weight)."""
    sr = state.secure
    if sr is None or state.phase != "training" or manifest.round != state.round:
        return f"no masked input is expected now (PS is in {state.phase} round {state.round})"
    if sr.stage != "masked":
        return f"a masked input while secure aggregation is at its {sr.stage} stage"
    if site not in state.selected:
        return "site was not selected for this round"
    floats = {n: v for n, v in machine.shared_model(state).items() if np.asarray(v).dtype.kind == "f"}
    length = sum(int(np.asarray(v).size) for v in floats.values()) + 1
    ring = machine.config.secure_aggregation.ring_bits
    entries = [(t.name, t.dtype, tuple(t.shape)) for t in manifest.tensor_index]
    if entries != [("masked", f"int{ring}", (length,))]:
        return f"a masked input is one int{ring} vector of {length} coordinates, not {entries[:2]}"
    budget = length * ring // 8 + CHUNKED_UPDATE_SLACK_BYTES
    if manifest.total_bytes > budget:
        return f"chunked masked input of {manifest.total_bytes} bytes; this model's needs at most {budget}"
    return None


def secure_update_rejection(msg: ClientUpdate) -> str | None:
    """Under secure aggregation the update says how the site trained and carries nothing to aggregate."""
    if msg.tensors or msg.control_variates or msg.layer_stats:
        return "under secure aggregation an update carries no tensors: they travel masked (secagg_masked)"
    if msg.label_set is not None:
        return "under secure aggregation an update names no label set: its output rows travel masked label by label"
    if not msg.no_step_reason and (msg.n_samples < 1 or msg.local_steps < 1):
        return (f"an update needs at least one training sample and one local step (got {msg.n_samples}, "
                f"{msg.local_steps})")
    return None


__all__ = ["histogram_rejection", "manifest_rejection", "model_layout", "report_rejection", "update_rejection"]


def _model_or_session_rejection(state: DaemonState, msg: EvalReport) -> str | None:
    """Both kinds of evaluation report must score the PS's current model for this start of the run."""
    if msg.model_hash != state.model_hash:
        return "evaluated a different model version"
    if msg.session != state.session:
        return f"answers session {msg.session[:16]!r}, not this start of the run ({state.session})"
    return None
