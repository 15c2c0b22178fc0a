"""FedFBN (Kulkarni et al. 2023; docs/algorithms.md section 14): frozen BN, uniform mean, surgical head."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field

from fedmqtt.strategies.aggregate import combine, copy_weights, uniform_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, SiteUpdate, TensorSpec, Weights
from fedmqtt.strategies.params import StrategyParams
from fedmqtt.strategies.rule import ServerRule, keeps_norm_local
from fedmqtt.strategies.strategy_doc import StrategyDoc

if TYPE_CHECKING:
    from fedmqtt.strategies.sums import LabelSums

LabelRows = dict[str, dict[str, np.ndarray]]  # label -> output-layer tensor name -> that label's row


class FedFBNParams(StrategyParams):
    partial_labels: Literal["surgical", "masked_loss"] = Field(
        default="surgical",
        description="partial labels: surgical (per-label mean of output rows) or masked_loss (plain mean)",
    )


def surgical_aggregate(
    uploads: Mapping[str, tuple[Sequence[str], Mapping[str, np.ndarray]]],
    previous: Mapping[str, Mapping[str, np.ndarray]] | None = None,
) -> tuple[LabelRows, dict[str, Weights]]:
    """Surgical aggregation of the output layer for partial labels (arXiv 2301.06683).

    For each label of the union, each output tensor's row is the uniform mean over the sites that
    have this label (sites summed in id order, float64, cast back); a label nobody uploaded keeps
    its `previous` rows.

    Args:
        uploads: site id -> (its labels in row order, {tensor name: array with one row per label}),
            e.g. {"a": (["L1", "L2"], {"fc.weight": [[1, 1], [2, 2]], "fc.bias": [0.1, 0.2]})}.
        previous: the last global rows per label (server state).

    Returns:
        (global rows per label, per site {tensor name: the rows of its own labels in its own order}).
    """
    rows: LabelRows = {label: copy_weights(r) for label, r in (previous or {}).items()}
    sites = sorted(uploads)
    for site in sites:
        labels, tensors = uploads[site]
        for name, array in tensors.items():
            if np.shape(array)[:1] != (len(labels),):
                raise ValueError(
                    f"fedfbn: {site!r} sent {len(labels)} labels but {name!r} has shape {np.shape(array)}"
                )
    union = sorted({str(label) for site in sites for label in uploads[site][0]})
    for label in union:
        holders = [(site, list(uploads[site][0]).index(label)) for site in sites if label in uploads[site][0]]
        names = uploads[holders[0][0]][1]
        merged: dict[str, np.ndarray] = {}
        for name in names:
            arrays = [np.asarray(uploads[site][1][name])[k] for site, k in holders]
            merged[name] = combine_rows(arrays)
        rows[label] = merged
    personal = {  # a site with no label gets its tensors with no rows
        site: {name: np.stack([rows[label][name] for label in uploads[site][0]]) if len(uploads[site][0])
               else np.asarray(array)[:0] for name, array in uploads[site][1].items()}
        for site in sites
    }
    return rows, personal


def combine_rows(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Uniform mean of one label's rows in float64, in the rows' dtype."""
    acc = np.zeros(np.shape(arrays[0]), dtype=np.float64)
    for arr in arrays:
        acc += np.asarray(arr, dtype=np.float64) / len(arrays)
    return acc.astype(np.asarray(arrays[0]).dtype)


class FedFBN(ServerRule):
    """FedFBN (Kulkarni et al. 2023, Algorithm 1): BatchNorm frozen and never sent;
    w_{t+1} = (1/|S_t|) sum_{i in S_t} w_i^t over every other tensor, regardless of n_i.

    Output layer (HEAD tensors) with `partial_labels = "surgical"` (the default): every site carries the union
    output layer (row r = label r) and names the labels it annotates in extras["label_set"] (increasing row
    indices; the wire's `ClientUpdate.label_set`). Row r of each HEAD tensor is the uniform mean over the sites
    that annotate label r (`surgical_aggregate` on their own rows); a label none of them annotates keeps its
    current rows. The rows go out in the shared model and are kept per label (str(r)) as server state, as the
    secure sum's `aggregate_from_label_sums` keeps them. An update without a label set is refused (ValueError):
    averaging its output layer like the rest would silently be `masked_loss`. With `masked_loss` the output layer
    is averaged like the rest.
    """

    name = "fedfbn"
    summary = "FedFBN: frozen BatchNorm, uniform mean, surgical output layer (Kulkarni et al. 2023)"
    Params = FedFBNParams
    params: FedFBNParams
    uplink_extras = ("label_set",)
    needs_only_sums = True
    sums_uniform = True
    sums_note = (
        "the plain mean of the shared tensors (each site weighs its masked vector by 1); the surgical output layer "
        "(partial_labels = \"surgical\") from per-label sums: each site masks row r of the output layer times 1 "
        "if it annotates label r, else 0, and those K zeros and ones; the PS learns how many summed sites "
        "annotate each label"
    )

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.label_rows: LabelRows = {}

    def keeps_local(self, spec: TensorSpec) -> bool:
        return keeps_norm_local(spec, ("batchnorm",))

    @property
    def sums_label_rows(self) -> bool:
        """The output layer is averaged label by label (surgical): in the clear each update names its labels
        (extras["label_set"]), under secure aggregation the sum carries per-label sums (`LabelSums`)."""
        return self.params.partial_labels == "surgical"

    def uniform_mean_refusal(self) -> str | None:
        return None

    def aggregate_from_label_sums(self, inp: RoundInput, mean: Mapping[str, np.ndarray], count: int,
                                  sums: LabelSums) -> AggregateResult:
        """Surgical aggregation from a secure sum, every site carrying the union output layer (row r = label r):
        the other tensors from their plain mean; row r of each output tensor is its sum over the sum of its
        label's weights, i.e. the mean over the sites that annotate label r, as `surgical_aggregate` gives; a
        label no summed site annotates keeps its current rows. The rows go out in the shared model (every site
        takes its own from the union layer), and are kept per label (its row index) as server state."""
        one = SiteUpdate(site_id="secure-sum", tensors=dict(mean), n_samples=count, local_steps=0)
        result = AggregateResult(weights=self._uniform(replace(inp, updates=[one]), per_label=False))
        weights = dict(result.weights)
        for name, summed in sums.rows.items():
            current = np.asarray(inp.current[name])
            rows = current.astype(np.float64)
            for r in np.flatnonzero(np.asarray(sums.holders) > 0):
                rows[r] = summed[r] / sums.weight[r]
                self.label_rows.setdefault(str(r), {})[name] = rows[r].astype(current.dtype)
            weights[name] = rows.astype(current.dtype)
        return replace(result, weights=weights)

    def head_names(self, inp: RoundInput) -> list[str]:
        """The shared output tensors (HEAD in the manifest, one row per label) that `inp.current` holds."""
        g = self.groups(inp)
        return [n for n in g.train + g.floatbuf
                if n in inp.manifest and inp.manifest[n].is_head and np.ndim(inp.current[n]) >= 1]

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        if not inp.updates:
            return AggregateResult(weights=copy_weights(inp.current))
        return AggregateResult(weights=self._uniform(inp, per_label=self.sums_label_rows))

    def _uniform(self, inp: RoundInput, *, per_label: bool) -> Weights:
        """The uniform mean of the shared tensors; with `per_label`, each output row over its label's holders."""
        g = self.groups(inp)
        head = self.head_names(inp) if per_label else []
        body = [n for n in g.train + g.floatbuf + g.intbuf if n not in head]
        out = combine(inp.updates, uniform_weights(len(inp.updates)), body, inp.current)
        if head:
            out.update(self._per_label_rows(inp, head))
        return self.complete(inp, out)

    def _per_label_rows(self, inp: RoundInput, head: Sequence[str]) -> Weights:
        """Each HEAD tensor with row r the mean over the updates whose label set holds r (`surgical_aggregate`
        on their own rows), the rows no update annotates as in `inp.current`; self.label_rows updated."""
        missing = sorted(u.site_id for u in inp.updates if u.extras.get("label_set") is None)
        if missing:
            raise ValueError(
                f"fedfbn: partial_labels = \"surgical\" averages the output layer label by label, and the updates "
                f"of {missing} name no label set (the labels their site annotates): averaging their output rows "
                f"like the rest would silently be masked_loss")
        uploads: dict[str, tuple[list[str], dict[str, np.ndarray]]] = {}
        for u in inp.updates:
            held = [int(r) for r in u.extras["label_set"]]
            for name in head:
                k = np.shape(inp.current[name])[0]
                if held != sorted(set(held)) or any(not 0 <= r < k for r in held):
                    raise ValueError(f"fedfbn: {u.site_id!r}: label set {held[:8]} is not increasing row indices "
                                     f"of {name!r}'s {k} rows")
            uploads[u.site_id] = ([str(r) for r in held], {n: np.asarray(u.tensors[n])[held] for n in head})
        self.label_rows, _ = surgical_aggregate(uploads, self.label_rows)
        held_now = sorted({int(label) for labels, _ in uploads.values() for label in labels})
        out: Weights = {}
        for name in head:
            rows = np.array(inp.current[name], copy=True)
            for r in held_now:
                rows[r] = self.label_rows[str(r)][name]
            out[name] = rows
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"label_rows": {label: copy_weights(r) for label, r in self.label_rows.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.label_rows = {str(k): copy_weights(r) for k, r in state.get("label_rows", {}).items()}


ABOUT = StrategyDoc(
    section="14",
    title="FedFBN (frozen BatchNorm) and surgical aggregation",
    names=("fedfbn",),
    summary=(
        "A pretrained backbone whose BatchNorm layers are frozen for the whole federation: they always run "
        "in inference mode with the pretrained statistics and are not trained, so every site holds identical "
        "BN layers and there is a usable global model. Every other tensor is averaged uniformly. With "
        "partial labels (each site annotates only some classes), the output layer is aggregated label by "
        "label (surgical aggregation). The pretrained backbone is the run's `init_model` (tensors = "
        "\"matching\" keeps the model's own output layer where the pretraining had other classes; "
        "`fedmqtt pretrain` trains one centrally); without it the frozen statistics are the seeded ones."
    ),
    server="""
body (all non-BN tensors except the output layer):
    w_{t+1} = (1/|S_t|) * sum_{i in S_t} w_i^t          regardless of n_i
output layer with partial_labels = masked_loss: averaged like the body
output layer with partial_labels = surgical (the default; every site carries the union layer, row r = label r,
and names the labels it annotates, its label set):
    for every label r: row_r = mean of row_r over the participants whose label set holds r
    a label no participant annotates keeps its current rows; an update without a label set is refused
BN tensors: never sent (identical by construction)
""",
    client="""
BN modules in eval mode after every model.train(), weight and bias frozen and out of the optimiser;
train every other parameter on the loss, masked to the labels it annotates; with surgical aggregation
send its label set (the output rows its data annotate) with every update, in the clear, or mask row r
times 1 or 0 under secure aggregation
""",
    state="Server: the global output rows per label (surgical aggregation). Sites: none beyond the model.",
    papers=("Kulkarni, Kanhere, Yi, Parekh: Optimizing federated learning for medical image "
            "classification on distributed non-iid datasets with partial labels (arXiv 2303.06180).",
            "Kulkarni, Kanhere, Yi, Parekh: Surgical aggregation: a collaborative learning framework for "
            "harmonizing distributed medical imaging datasets with diverse tasks (arXiv 2301.06683).",),
    differences=(
        "BN tensors are never transmitted; the authors' code (`FedBNplus`) sends and averages the whole "
        "state, which gives the same result because the frozen layers are identical.",
        "Partial participation is not covered by the sources: uniform mean over the participants.",
        "`partial_labels = \"masked_loss\"`: every site carries the full union output layer, masks the "
        "labels it does not annotate in its loss, and the output layer is averaged like the rest (the "
        "sources report that this does worse on labels a site never sees).",
    ),
    example="""
Uniform averaging: [1, 2] and [3, 0] with n = (1, 3) give [2, 1] (FedAvg: [2.5, 0.5]). Surgical, three labels
(rows 0, 1, 2): site A annotates (0, 1), its rows [1, 1], [2, 2], [9, 9] (biases 0.1, 0.2, 0.9); site B annotates
(1, 2), its rows [7, 7], [4, 0], [5, 5] (0.7, 0.4, 0.5). Global rows: 0 = [1, 1], 0.1 (A's); 1 = [3, 1], 0.3;
2 = [5, 5], 0.5 (B's); the plain mean would give [4, 4], [3, 1], [7, 7].
""",
)
