"""Hostile bytes on the wire: nothing a party can send crashes, hangs or bloats a receiver, or passes unchecked.

Property tests (hypothesis) feed arbitrary bytes, arbitrary nested JSON and msgpack documents, and valid messages
of every kind with one field made hostile through `decode`, `check_message` and `Channel.accept` over the
in-process broker (fedmqtt.transport.memory); the real-Mosquitto fuzzing is in the integration tests. Unit tests
pin the depth and size limits, the bfloat16/float16 finite checks and the chunked-transfer memory bounds.
"""

from __future__ import annotations

import json
import math
import random
import time
import tracemalloc
import typing
from typing import Any

import msgpack
import numpy as np
import pytest
from feature_examples import feature_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from secagg_examples import secagg_examples
from signed_wire import identity, ring, signed

from fedmqtt.errors import SchemaError, TopicError
from fedmqtt.transport import topics
from fedmqtt.transport.bulk import split
from fedmqtt.transport.channel import Channel, check_message
from fedmqtt.transport.memory import SIMULATION_SETTINGS, MemoryBroker, MemoryTransport
from fedmqtt.transport.mqtt import RawMessage
from schemas import codec
from schemas import messages as m
from schemas.chunks import Chunk, ChunkManifest, TensorEntry, chunk_digest, root_digest
from schemas.codec import MAX_DEPTH, WireError, decode, encode, json_depth
from schemas.signed import KeyList, PartyKey
from schemas.tensors import TensorBlob, all_finite, arrays_to_blobs

RUN = "run-1"
MAX = 1 << 20
# Fast, bounded fuzzing: the whole module stays well under 30 s on a busy two-core machine.
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHANNEL_FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = SIMULATION_SETTINGS.model_copy(update={
    "chunk_threshold_bytes": 2048, "chunk_bytes": 1024, "fetch_window_bytes": 4096, "max_payload_bytes": MAX})


# -- examples of every kind ------------------------------------------------------------------------------------
def _blobs() -> tuple[TensorBlob, ...]:
    return arrays_to_blobs({"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
                            "fc.bias": np.array([0.5, -1.25], dtype=np.float32),
                            "steps": np.array(12, dtype=np.int64), "mask": np.array([True, False])})


def _manifest(sender: str = "ps") -> ChunkManifest:
    digests = (chunk_digest(b"\x01" * 2048), chunk_digest(b"\x02" * 100))
    return ChunkManifest(run_id=RUN, sender=sender, round=1, inner_kind="global_model", transfer_id="t" * 32,
                         total_bytes=2148, chunk_bytes=2048, chunk_sha256=digests, root_sha256=root_digest(digests),
                         tensor_index=(TensorEntry(name="fc.weight", dtype="float32", shape=(2, 3)),))


def _examples() -> list[BaseModel]:
    """One message of every kind, optional parts filled in, as legitimate traffic sends them."""
    b = _blobs()
    usage = m.ResourceUsage(device="cuda:0", wall_s=1.5, cpu_s=1.2, energy_j=310.5, gpu_util_pct=87.0,
                            gpu_peak_mem_mb=812.0, amp="bfloat16")
    settings_ = m.TrainSettings(epochs=2, steps_per_epoch=3, lr=0.01, weight_decay=1e-4, seed=7,
                                hyper={"mu": 0.01})
    return [
        m.GlobalModel(run_id=RUN, sender="ps", round=3, session="ab12", model=m.ModelSpec(name="mlp", args={
            "hidden": [64, 32], "dropout": 0.1, "act": "relu", "bias": True}), model_hash="h" * 64, tensors=b,
            extras={"c": b}),
        m.TrainTask(run_id=RUN, sender="ps", round=3, site_id="site-a", model_hash="h" * 64, deadline=1.7e9,
                    settings=settings_, accepted_round=2, tensors=b, upload=("fc.weight",), best_round=1,
                    per_label_tensors=("fc.weight", "fc.bias")),
        m.EvalTask(run_id=RUN, sender="ps", round=3, site_id="site-a", model_hash="h" * 64, accepted_round=2,
                   best_round=1),
        m.RecruitmentResult(run_id=RUN, sender="ps", round=0, site_id="site-a", recruited=True, score=0.7, rank=1,
                            candidates=4, detail="top 3 of 4"),
        m.UploadTurn(run_id=RUN, sender="ps", round=3, site_id="site-a", grant=7),
        m.ClientUpdate(run_id=RUN, sender="site-a", round=3, base_model_hash="h" * 64, tensors=b, n_samples=120,
                       local_steps=8, train_loss=0.42, val_metrics={"auroc": 0.8, "auprc": None},
                       undefined={"auprc": "only one class"}, control_variates=b, scalars={"a_norm": 3.0},
                       layer_stats=b, label_histogram={"0": 70, "1": 50}, compute_seconds=1.5, usage=usage,
                       label_set=(0, 2, 5)),
        m.EvalReport(run_id=RUN, sender="site-a", round=3, model_hash="h" * 64, tag="final",
                     metrics={"val": {"auroc": None, "accuracy": 0.75}, "best.test": {"loss": 0.2}},
                     n_samples={"val": 20, "test": 21}, undefined={"val.auroc": "one class"}, best_round=2),
        m.SiteStatus(run_id=RUN, sender="site-a", round=0, state="online", n_train=100, n_val=20, n_test=21,
                     label_histogram={"0": 60, "1": 40}, detail="ready", version="0.1.0"),
        m.DaemonStatus(run_id=RUN, sender="ps", round=2, state="training", algorithm="fedavg", rounds_total=5,
                       sites_expected=("site-a", "site-b"), sites_online=("site-a",), waiting_for=("site-b",),
                       deadline=1.7e9, detail="round 2", session="ab12", rejected={"site-b": {"malformed": 2}}),
        m.RoundMetrics(run_id=RUN, sender="ps", round=2, sites=("site-a", "site-b"), stragglers=("site-c",),
                       per_site={"site-a": {"auroc": 0.8}, "site-b": {"auroc": None}}, mean={"auroc": 0.8},
                       train_loss=0.3, duration_s=4.25),
        _manifest(),
        Chunk(run_id=RUN, sender="ps", round=1, transfer_id="t" * 32, index=0, data=b"\x01" * 2048),
        KeyList(run_id=RUN, sender="coordinator", round=0, version=2, keys={"ps": PartyKey(ed25519="A" * 43)}),
        *secagg_examples(RUN),
        *feature_examples(RUN),
    ]


EXAMPLES = _examples()


def _payload(doc: Any, *, text: bool) -> bytes:
    """Bytes for a (possibly hostile) document: JSON for observer kinds, msgpack otherwise, JSON when msgpack
    cannot carry a value (an integer beyond 64 bits)."""
    if not text:
        try:
            return msgpack.packb(doc, use_bin_type=True)
        except (OverflowError, TypeError, ValueError):
            pass
    return json.dumps(doc, default=lambda o: o.decode("latin-1")).encode()


def _leaf_paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a document, containers and leaves alike."""
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _leaf_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _leaf_paths(v, prefix + (i,))
    return out


def _replace(doc: Any, path: tuple, value: Any) -> Any:
    head, *rest = path
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[head] = value if not rest else _replace(copy[head], tuple(rest), value)
    return copy


def _plain(message: BaseModel) -> dict:
    """The message as msgpack/JSON would carry it (tuples as lists)."""
    return msgpack.unpackb(msgpack.packb(message.model_dump(mode="python"), use_bin_type=True), raw=False)


def _contains_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_contains_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_contains_non_finite(v) for v in value)
    return False


def test_examples_cover_every_kind_and_round_trip() -> None:
    union = typing.get_args(typing.get_args(m.Message)[0])
    assert {e.kind for e in EXAMPLES} == {cls.model_fields["kind"].default for cls in union}
    for message in EXAMPLES:
        assert decode(encode(message)) == message


# -- strategies ------------------------------------------------------------------------------------------------
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30), st.binary(max_size=30))
_documents = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=10), inner, max_size=6)), max_leaves=40)
_hostile_values = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -1, -(2**63), 2**63, 2**64 - 1, 2**200,
                     10**4000, "", "x" * 5000, "\n\x00\u202e", [], {}, None, True, b"\x00" * 3, [[[[]]]],
                     {"a": {"b": 1}}, [float("nan")], {"k": float("inf")}]),
    st.integers(), st.floats(), st.text(max_size=40), st.binary(max_size=40), _documents)


def _hostile_tensors() -> st.SearchStrategy[dict]:
    """Tensor dicts that are wrong in one way: a dtype off the list, bytes that do not fit the shape, NaN/Inf in
    any float dtype (bfloat16 and float16 included), absurd shapes."""
    nan16 = {"float16": b"\x00\x7e", "bfloat16": b"\xc0\x7f"}  # quiet NaN, little-endian
    inf16 = {"float16": b"\x00\x7c", "bfloat16": b"\x80\xff"}  # +Inf, -Inf
    cases = [
        {"name": "w", "dtype": "bfloat16", "shape": [2], "data": b"\x80\x3f" + nan16["bfloat16"]},
        {"name": "w", "dtype": "bfloat16", "shape": [1], "data": inf16["bfloat16"]},
        {"name": "w", "dtype": "float16", "shape": [1], "data": nan16["float16"]},
        {"name": "w", "dtype": "float16", "shape": [1], "data": inf16["float16"]},
        {"name": "w", "dtype": "float32", "shape": [1], "data": np.float32("nan").tobytes()},
        {"name": "w", "dtype": "float64", "shape": [1], "data": np.float64("-inf").tobytes()},
        {"name": "w", "dtype": "complex64", "shape": [1], "data": b"\x00" * 8},
        {"name": "w", "dtype": "object", "shape": [1], "data": b"\x00" * 8},
        {"name": "w", "dtype": "float32", "shape": [3], "data": b"\x00" * 8},
        {"name": "w", "dtype": "float32", "shape": [-1], "data": b""},
        {"name": "w", "dtype": "int8", "shape": [2**40, 2**40, 2**40], "data": b""},
        {"name": "w", "dtype": "int8", "shape": [2] * 17, "data": b"\x00" * 2**17},
        {"name": "", "dtype": "int8", "shape": [1], "data": b"\x00"},
        {"name": "w" * 300, "dtype": "int8", "shape": [1], "data": b"\x00"},
    ]
    return st.sampled_from(cases)


def _assert_only_schema_errors(payload: bytes, **kw: Any) -> BaseModel | None:
    try:
        return decode(payload, **kw)
    except SchemaError as exc:
        text = str(exc)
        assert text and len(text) <= 1200 and "\n" not in text, text
        assert isinstance(exc, WireError) and exc.category and len(exc.category) <= 32
        return None


# -- decode: arbitrary input -----------------------------------------------------------------------------------
@FUZZ
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_raise_only_schema_errors(data: bytes) -> None:
    _assert_only_schema_errors(data)
    _assert_only_schema_errors(b"{" + data)  # the JSON branch too


@FUZZ
@given(_documents)
def test_arbitrary_documents_raise_only_schema_errors(doc: Any) -> None:
    for text in (False, True):
        payload = _payload(doc, text=text)
        if text:
            payload = json.dumps(doc, default=lambda o: o.decode("latin-1")).encode()
        _assert_only_schema_errors(payload)


@FUZZ
@given(st.integers(min_value=1, max_value=20_000), st.sampled_from(["[", "{\"a\":", "[1,{\"b\":["]))
def test_deep_json_is_refused_before_parsing(depth: int, opener: str) -> None:
    """Deep documents never reach json.loads's recursion: refused as 'too deep' (or malformed), quickly."""
    closer, levels = {"[": ("]", 1), "{\"a\":": ("}", 1), "[1,{\"b\":[": ("]}]", 3)}[opener]
    doc = ("{\"x\":" + opener * depth + "0" + closer * depth + "}").encode()
    started = time.perf_counter()
    with pytest.raises(WireError) as info:
        decode(doc)
    assert time.perf_counter() - started < 1.0
    assert info.value.category == ("too deep" if 1 + levels * depth > MAX_DEPTH else "wrong version")


@FUZZ
@given(st.integers(min_value=1, max_value=5000))
def test_deep_msgpack_is_refused(depth: int) -> None:
    payload = b"\x81\xa1x" + b"\x91" * depth + b"\x00"  # {"x": [[[...0...]]]}
    with pytest.raises(WireError) as info:
        decode(payload)
    assert info.value.category in ({"too deep"} if depth + 1 > MAX_DEPTH else {"wrong version"})


# -- decode: valid messages with one hostile field ---------------------------------------------------------------
@FUZZ
@given(st.data())
def test_one_hostile_field_in_any_message_is_refused_or_harmless(data: st.DataObject) -> None:
    """Mutate one field (or anything inside one) of a valid message of any kind. Either it is refused with a
    SchemaError, or what comes back is a message that re-encodes and decodes to itself (the value was legal).
    Non-finite numbers never pass, wherever they are put."""
    message = data.draw(st.sampled_from(EXAMPLES), label="kind")
    doc = _plain(message)
    path = data.draw(st.sampled_from(_leaf_paths(doc)), label="path")
    value = data.draw(_hostile_values, label="value")
    hostile = _replace(doc, path, value)
    result = _assert_only_schema_errors(_payload(hostile, text=message.kind in m.TEXT_KINDS))
    if result is not None:
        assert decode(encode(result)) == result
        assert not _contains_non_finite(value)


@FUZZ
@given(st.sampled_from([e for e in EXAMPLES if any(isinstance(getattr(e, f, None), tuple) and getattr(e, f)
                                                   and isinstance(getattr(e, f)[0], TensorBlob)
                                                   for f in ("tensors", "control_variates", "layer_stats"))]),
       st.sampled_from(["tensors", "control_variates", "layer_stats"]), _hostile_tensors())
def test_a_hostile_tensor_is_always_refused(message: BaseModel, field: str, tensor: dict) -> None:
    doc = _plain(message)
    if field not in doc:
        field = "tensors"
    doc[field] = [tensor] + list(doc[field])
    with pytest.raises(WireError) as info:
        decode(_payload(doc, text=False))
    assert info.value.category in {"non-finite", "tensor layout", "schema", "too large", "out of range"}


@pytest.mark.parametrize(("field", "value"), [
    ("compute_seconds", float("inf")), ("compute_seconds", -1.0), ("train_loss", float("nan")),
    ("sent_at", float("inf")), ("round", 10**9), ("round", -1), ("n_samples", 2**60), ("local_steps", -3),
    ("scalars", {"a_norm": float("inf")}), ("val_metrics", {f"m{i}": 0.5 for i in range(300)}),
    ("train_loss", 1e308), ("val_metrics", {"loss": -1e300}),  # finite, but a mean of them would not be
    ("label_histogram", {"0": -1}), ("undefined", {"auroc": "x" * 3000}),
    ("usage", {"device": "cpu", "wall_s": 1.0, "cpu_s": float("nan")}),
    ("usage", {"device": "cpu", "wall_s": 1.0, "cpu_s": 1.0, "gpu_util_pct": 1e9}),
])
def test_scalar_fields_are_finite_and_in_range(field: str, value: Any) -> None:
    update = next(e for e in EXAMPLES if e.kind == "client_update")
    doc = {**_plain(update), field: value}
    with pytest.raises(WireError) as info:
        decode(_payload(doc, text=False))
    assert info.value.category in {"non-finite", "out of range", "too large", "schema"}


@pytest.mark.parametrize(("kind", "field", "value"), [
    ("train_task", "deadline", float("inf")), ("train_task", "settings", {"lr": float("nan")}),
    ("train_task", "settings", {"weight_decay": -1.0}), ("train_task", "settings", {"hyper": {"mu": float("inf")}}),
    ("recruitment_result", "score", float("-inf")), ("recruitment_result", "detail", "x" * 5000),
    ("round_metrics", "duration_s", float("inf")), ("round_metrics", "train_loss", float("nan")),
    ("daemon_status", "deadline", float("inf")), ("site_status", "version", "v" * 1000),
    ("site_status", "n_train", -5), ("global_model", "model", {"name": "mlp", "args": {"x": float("nan")}}),
    ("chunk_manifest", "total_bytes", 10**400), ("chunk", "index", 10**6),
    ("feature_summary", "total", [float("nan"), 0.0]), ("feature_summary", "bins", 10**6),
    ("feature_summary", "columns", ["c" * 1000, "flag"]), ("feature_statistics", "std", [-1.0, 1.0]),
    ("feature_statistics", "mean", [1e300, 0.0]), ("feature_statistics", "low", [100.0, None]),
])
def test_every_kind_bounds_its_numbers_and_strings(kind: str, field: str, value: Any) -> None:
    message = next(e for e in EXAMPLES if e.kind == kind)
    doc = _plain(message)
    doc[field] = {**doc[field], **value} if isinstance(doc.get(field), dict) and isinstance(value, dict) else value
    with pytest.raises(WireError):
        decode(_payload(doc, text=kind in m.TEXT_KINDS))


def test_a_huge_json_integer_is_a_schema_error_not_an_overflow() -> None:
    """Regression: a JSON manifest with total_bytes = 10**400 once raised OverflowError in its validator."""
    doc = {**_plain(_manifest()), "total_bytes": 10**400}
    with pytest.raises(WireError):
        decode(json.dumps(doc, default=lambda b: b.hex()).encode())


def test_each_kind_must_travel_in_its_own_encoding() -> None:
    status = next(e for e in EXAMPLES if e.kind == "site_status")
    with pytest.raises(WireError, match="must travel as JSON"):
        decode(msgpack.packb(_plain(status), use_bin_type=True))
    update = next(e for e in EXAMPLES if e.kind == "client_update")
    with pytest.raises(WireError, match="must travel as msgpack"):
        decode(json.dumps(_plain(update), default=lambda b: b.hex()).encode())


# -- limits ------------------------------------------------------------------------------------------------------
def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert json_depth(b'{"a": [[1]]}') == 3
    assert json_depth(b'{"a": "[[[[{{{{"}') == 1
    assert json_depth(b'{"a\\"[[[": "\\\\", "b": [[]]}') == 3  # escaped quote, escaped backslash
    assert json_depth(b'{"unterminated [[[[[[') == 1  # an open string runs to the end


def _true_depth(doc: Any) -> int:
    if isinstance(doc, dict):
        return 1 + max((_true_depth(v) for v in doc.values()), default=0)
    if isinstance(doc, list):
        return 1 + max((_true_depth(v) for v in doc), default=0)
    return 0


_tricky_text = st.text(alphabet='[]{}"\\\n ab\u00e9\u2028', max_size=12)
_tricky_docs = st.recursive(st.one_of(_tricky_text, st.integers(), st.none()), lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(_tricky_text, inner, max_size=4)), max_leaves=30)


@FUZZ
@given(_tricky_docs, st.sampled_from([1, 2, 3, 7, 64, 1 << 18]), st.booleans())
def test_json_depth_matches_the_real_nesting(doc: Any, block: int, ascii_only: bool) -> None:
    """Strings full of brackets, quotes and backslashes, and scan blocks that split escapes and strings
    anywhere: the pre-scan's depth is the document's."""
    data = json.dumps(doc, ensure_ascii=ascii_only).encode()
    original = codec._DEPTH_BLOCK
    codec._DEPTH_BLOCK = block
    try:
        assert json_depth(data) == _true_depth(doc) or _true_depth(doc) > MAX_DEPTH
    finally:
        codec._DEPTH_BLOCK = original


def test_depth_limit_is_exact_for_json_and_msgpack() -> None:
    for depth, ok in ((MAX_DEPTH, True), (MAX_DEPTH + 1, False)):
        inner = depth - 1  # the top-level map is level 1
        doc_json = b'{"x":' + b"[" * inner + b"0" + b"]" * inner + b"}"
        doc_msgpack = b"\x81\xa1x" + b"\x91" * inner + b"\x00"
        for payload in (doc_json, doc_msgpack):
            with pytest.raises(WireError) as info:
                decode(payload)
            assert (info.value.category == "too deep") is not ok, (depth, payload[:8], info.value)


def test_a_100000_deep_status_document_is_refused_without_recursion() -> None:
    """The reported crash: a deeply nested JSON document retained on a site's own status topic."""
    topic = topics.site_status_topic(RUN, "site-a")
    payload = b'{"kind": "site_status", "detail": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(WireError) as info:  # signed by site-a itself: its key does not make the content safe
        check_message(topic, signed(RUN, topic, payload), run_id=RUN, max_bytes=MAX, keys=ring(RUN))
    assert info.value.category == "too deep"


def test_a_topic_of_thousands_of_chunk_levels_is_a_topic_error_not_a_recursion() -> None:
    topic = topics.site_update_topic(RUN, "site-a") + "/chunk/0" * 3000  # a site may write site/<id>/#
    with pytest.raises(TopicError, match="not a fedmqtt topic"):
        check_message(topic, encode(next(e for e in EXAMPLES if e.kind == "chunk")), run_id=RUN, max_bytes=MAX,
                      keys=ring(RUN))


def test_finite_check_covers_every_block_of_a_large_tensor() -> None:
    from schemas import tensors

    n = 3 * tensors._FINITE_BLOCK + 5
    for dtype, bad in (("float32", np.float32("inf").tobytes()), ("bfloat16", b"\xc0\x7f")):
        size = 4 if dtype == "float32" else 2
        data = bytearray(n * size)
        assert all_finite(bytes(data), dtype)
        data[-size:] = bad  # the very last element of the last, partial block
        assert not all_finite(bytes(data), dtype)


@pytest.mark.parametrize(("payload", "category"), [
    (b"\x81\xa1x\xdd" + (codec.MAX_ARRAY_LEN + 1).to_bytes(4, "big"), "too large"),  # declared, not sent
    (b"\x81\xa1x\xdf" + (codec.MAX_MAP_LEN + 1).to_bytes(4, "big"), "too large"),
    (b"\x81\xa1x\xdb" + (codec.MAX_STR_LEN + 1).to_bytes(4, "big") + b"a" * (codec.MAX_STR_LEN + 1), "too large"),
    (b"\x81\xa1x\xc7\x05\x01abcde", "too large"),  # ext types never
    (b"\x81\x01\x02", "malformed"),  # an integer map key
    (b"\x81\xa1x\xc1", "malformed"),
    (b"{" + b" " * (codec.MAX_TEXT_BYTES + 1), "too large"),
    (b'{"sent_at": NaN}', "non-finite"), (b'{"sent_at": 1e999}', "non-finite"), (b'{"x": Infinity}', "non-finite"),
])
def test_size_and_format_limits(payload: bytes, category: str) -> None:
    with pytest.raises(WireError) as info:
        decode(payload, max_bytes=64 << 20)
    assert info.value.category == category, info.value


def test_too_many_containers_is_refused() -> None:
    # 1.1 million empty lists in 1.1 MB: ~60 MB of Python objects if it were parsed to the end
    n = codec.MAX_CONTAINERS + 100_000
    payload = b"\x81\xa1x\x92" + b"\xdd" + (n // 2).to_bytes(4, "big") + b"\x90" * (n // 2) \
        + b"\xdd" + (n - n // 2).to_bytes(4, "big") + b"\x90" * (n - n // 2)
    with pytest.raises(WireError) as info:
        decode(payload)
    assert info.value.category == "too large"


def test_reasons_are_one_bounded_printable_line() -> None:
    update = _plain(next(e for e in EXAMPLES if e.kind == "client_update"))
    nasty = "\n[ERROR] forged log line\x1b[31m" + "k" * 100_000
    for doc in ({**update, "kind": nasty}, {**update, "val_metrics": {nasty: 1.0}}, {**update, nasty: 1}):
        with pytest.raises(WireError) as info:
            decode(msgpack.packb(doc, use_bin_type=True))
        text = str(info.value)
        assert len(text) < 1000 and text.isprintable(), text


# -- tensors: bfloat16 and float16 -------------------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "bits", "finite"), [
    ("bfloat16", 0x3F80, True), ("bfloat16", 0x7F7F, True), ("bfloat16", 0xFF7F, True),  # 1.0, +-max
    ("bfloat16", 0x0001, True),  # a subnormal
    ("bfloat16", 0x7F80, False), ("bfloat16", 0xFF80, False), ("bfloat16", 0x7FC0, False), ("bfloat16", 0x7F81, False),
    ("float16", 0x7BFF, True), ("float16", 0x7C00, False), ("float16", 0xFC00, False), ("float16", 0x7E00, False),
])
def test_16_bit_floats_are_checked_for_nan_and_inf(dtype: str, bits: int, finite: bool) -> None:
    data = np.array([0x3C00, bits], dtype="<u2").tobytes()
    assert all_finite(data, dtype) is finite
    if finite:
        TensorBlob(name="w", dtype=dtype, shape=(2,), data=data)
    else:
        with pytest.raises(ValueError, match="NaN or Inf"):
            TensorBlob(name="w", dtype=dtype, shape=(2,), data=data)


def test_bfloat16_has_no_numpy_view_but_an_exact_float32_copy() -> None:
    values = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    bf16 = (values.view("<u4") >> 16).astype("<u2").tobytes()  # these values are exact in bfloat16
    blob = TensorBlob(name="w", dtype="bfloat16", shape=(2, 2), data=bf16)
    with pytest.raises(ValueError, match="bfloat16"):
        blob.to_numpy()
    np.testing.assert_array_equal(blob.to_float32(), values.reshape(2, 2))


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "bool"])
def test_integer_and_bool_tensors_pass_whatever_their_bits(dtype: str) -> None:
    size = np.dtype(dtype).itemsize
    data = b"\xff" * (3 * size) if dtype != "bool" else b"\x01\x00\x01"
    blob = TensorBlob(name="w", dtype=dtype, shape=(3,), data=data)
    assert blob.to_numpy().shape == (3,)


# -- channel -----------------------------------------------------------------------------------------------------
def _ps_channel(broker: MemoryBroker | None = None, **kw: Any) -> Channel:
    broker = broker or MemoryBroker()

    def factory(**f: Any) -> MemoryTransport:
        return MemoryTransport(broker, SMALL, **f)

    ps = Channel.open(factory, client_id="ps", will=None, run_id=RUN, identity=identity(RUN, "ps"))
    ps.admit_manifest = kw.get("admit_manifest")
    ps.connect()
    return ps


# topic -> whose rejection counter a refused message on it must raise
_OWNERS = {**{topics.site_topic(RUN, s, k): s for s in ("site-a", "site-b") for k in topics.SITE_KINDS},
           "fedmqtt/v1/run-1/site/site-a/secrets": "?", "x/y": "?", "fedmqtt/v1/other-run/site/site-b/update": "site-b",
           topics.ps_status_topic(RUN): "ps", topics.ps_task_topic(RUN, "site-a"): "ps",
           topics.site_update_topic(RUN, "site-a") + "/chunk/0" * 3000: "?", "fedmqtt/v1/" + "x" * 70_000: "?"}
_TOPICS = st.sampled_from(sorted(_OWNERS))


def _hostile_payloads() -> st.SearchStrategy[bytes]:
    def mutated(draw_data: tuple) -> bytes:
        message, path_seed, value = draw_data
        doc = _plain(message)
        paths = _leaf_paths(doc)
        return _payload(_replace(doc, paths[path_seed % len(paths)], value), text=message.kind in m.TEXT_KINDS)

    return st.one_of(
        st.binary(max_size=300),
        _documents.map(lambda d: _payload(d, text=False)),
        st.tuples(st.sampled_from(EXAMPLES), st.integers(0, 10_000), _hostile_values).map(mutated),
        st.sampled_from(EXAMPLES).map(encode))


def _as_owner(topic: str, payload: bytes) -> bytes:
    """`payload` signed by the party that may write `topic` (a hostile party signs its own hostile messages)."""
    return signed(RUN, topic, payload) if _OWNERS[topic] != "?" and payload else payload


@CHANNEL_FUZZ
@given(st.lists(st.tuples(_TOPICS, _hostile_payloads(), st.booleans(), st.booleans()), min_size=1, max_size=8))
def test_channel_accept_never_raises_and_counts_every_rejection_per_site(batch: list) -> None:
    """Hostile payloads, most signed with the valid key of the topic's owner, some unsigned."""
    ps = _ps_channel()
    for topic, hostile, retain, sign in batch:
        payload = _as_owner(topic, hostile) if sign else hostile
        owner = _OWNERS[topic]
        before = (sum(ps.stats.rejected.values()), ps.stats.duplicates,
                  sum(ps.stats.rejected_by_site.get(owner, {}).values()))
        inbound = ps.accept(RawMessage(topic, payload, retain))
        rejected = sum(ps.stats.rejected.values()) - before[0]
        duplicates = ps.stats.duplicates - before[1]
        assert sum(ps.stats.rejected_by_site.get(owner, {}).values()) - before[2] == rejected  # the owner's
        if not payload:
            assert (inbound, rejected) == (None, 0)
            continue
        queued = inbound is None and rejected == 0 and duplicates == 0 and ps.fetcher.busy  # a manifest
        assert (inbound is not None) + rejected + duplicates + queued == 1, (topic, payload[:40])
    assert "internal error" not in ps.stats.rejected
    by_site = {site: sum(c.values()) for site, c in ps.stats.rejected_by_site.items()}
    assert sum(by_site.values()) == sum(ps.stats.rejected.values())
    assert set(by_site) <= {"site-a", "site-b", "ps", "?"}
    assert all(len(category) <= 32 for category in ps.stats.rejected)


def test_rejections_are_counted_by_the_topic_owner_and_logged_once(caplog) -> None:
    ps = _ps_channel()
    deep = b'{"kind": "site_status", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    status_b, update_a = topics.site_status_topic(RUN, "site-b"), topics.site_update_topic(RUN, "site-a")
    ps.accept(RawMessage(status_b, signed(RUN, status_b, deep), True))
    ps.accept(RawMessage(update_a, signed(RUN, update_a, b"\xc1"), False))
    ps.accept(RawMessage(update_a, b"\xc1", False))
    ps.accept(RawMessage("fedmqtt/v1/run-1/nowhere/at/all", b"\x00", False))
    forged = m.ClientUpdate(run_id=RUN, sender="site-b", round=1, base_model_hash="h", tensors=_blobs(),
                            n_samples=1, local_steps=1)
    ps.accept(RawMessage(update_a, signed(RUN, update_a, encode(forged)), False))
    assert ps.stats.rejected_by_site == {"site-b": {"too deep": 1},
                                         "site-a": {"malformed": 1, "unsigned": 1, "wrong sender": 1},
                                         "?": {"bad topic": 1}}
    lines = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == 5 and all(len(r.getMessage()) < 1500 for r in lines)


def test_a_site_cannot_suppress_another_partys_message_by_reusing_its_id() -> None:
    ps = _ps_channel()
    base = dict(run_id=RUN, round=1, base_model_hash="h", tensors=_blobs(), n_samples=1, local_steps=1,
                msg_id="same-id-123")
    update_a, update_b = topics.site_update_topic(RUN, "site-a"), topics.site_update_topic(RUN, "site-b")
    first = ps.accept(RawMessage(update_b, signed(RUN, update_b, encode(m.ClientUpdate(sender="site-b", **base))),
                                 False))
    second = ps.accept(RawMessage(update_a, signed(RUN, update_a, encode(m.ClientUpdate(sender="site-a", **base))),
                                  False))
    assert first is not None and second is not None
    replay = ps.accept(RawMessage(update_a, signed(RUN, update_a, encode(m.ClientUpdate(sender="site-a", **base))),
                                  False))
    assert replay is None and ps.stats.duplicates == 1


def test_a_flood_of_new_ids_does_not_evict_another_partys_ids() -> None:
    """The de-duplication window is per topic owner: site-a sending many messages cannot make a retained
    replay of site-b's update look new."""
    broker = MemoryBroker()
    ps = Channel(MemoryTransport(broker, SMALL, client_id="ps"), run_id=RUN, identity=identity(RUN, "ps"),
                 dedupe_window=8)
    status_b = topics.site_update_topic(RUN, "site-b")
    b_update = signed(RUN, status_b, encode(m.ClientUpdate(run_id=RUN, sender="site-b", round=1, base_model_hash="h",
                                                           tensors=_blobs(), n_samples=1, local_steps=1)))
    assert ps.accept(RawMessage(status_b, b_update, True)) is not None
    for i in range(50):
        flood = m.ClientUpdate(run_id=RUN, sender="site-a", round=1, base_model_hash="h", tensors=_blobs(),
                               n_samples=1, local_steps=1, msg_id=f"flood-{i:04d}")
        update_a = topics.site_update_topic(RUN, "site-a")
        ps.accept(RawMessage(update_a, signed(RUN, update_a, encode(flood)), False))
    assert ps.accept(RawMessage(status_b, b_update, True)) is None and ps.stats.duplicates == 1


def test_a_manifest_of_tiny_chunks_asks_for_a_bounded_number_of_topics() -> None:
    """1 KiB chunks and a 64 MiB window would be 65 536 topics in one SUBSCRIBE: capped (and a manifest names at
    most MAX_CHUNKS chunks, the chunk topics the broker's ACL grants)."""
    from fedmqtt.transport.bulk import MAX_WINDOW_CHUNKS
    from schemas.chunks import MAX_CHUNKS

    wide = SMALL.model_copy(update={"fetch_window_bytes": 64 << 20, "max_payload_bytes": 1 << 30})
    ps = Channel(MemoryTransport(MemoryBroker(), wide, client_id="ps"), run_id=RUN, identity=identity(RUN, "ps"))
    ps.connect()
    topic = topics.site_update_topic(RUN, "site-a")
    ps.accept(RawMessage(topic, _as_owner(topic, encode(_huge_manifest(MAX_CHUNKS << 10, chunk=1024))), True))
    assert ps.fetcher.busy and 0 < len([f for f in ps.bulk.filters if "/chunk/" in f]) <= min(MAX_WINDOW_CHUNKS,
                                                                                                  MAX_CHUNKS)


def _big_update(n: int = 3000, seed: int = 0, sender: str = "site-a", round_no: int = 1) -> m.ClientUpdate:
    rng = np.random.default_rng(seed)
    return m.ClientUpdate(run_id=RUN, sender=sender, round=round_no, base_model_hash="h",
                          tensors=arrays_to_blobs({"w": rng.normal(size=n).astype(np.float32)}), n_samples=1,
                          local_steps=1)


def _huge_manifest(total: int, sender: str = "site-a", chunk: int = 8 << 20) -> ChunkManifest:
    count = -(-total // chunk)
    digests = tuple(chunk_digest(i.to_bytes(4, "big")) for i in range(count))
    return ChunkManifest(run_id=RUN, sender=sender, round=1, inner_kind="client_update", transfer_id="x" * 32,
                         total_bytes=total, chunk_bytes=chunk, chunk_sha256=digests, root_sha256=root_digest(digests))


def test_a_1_gib_manifest_costs_almost_nothing() -> None:
    """The reported finding: one 9 kB manifest made the PS allocate the 1 GiB it declared."""
    big = SMALL.model_copy(update={"max_payload_bytes": 1 << 30})
    broker = MemoryBroker()
    ps = Channel(MemoryTransport(broker, big, client_id="ps"), run_id=RUN, identity=identity(RUN, "ps"))
    ps.connect()
    payload = _as_owner(topics.site_update_topic(RUN, "site-a"), encode(_huge_manifest(1 << 30)))
    assert len(payload) < 20_000
    tracemalloc.start()
    try:
        ps.accept(RawMessage(topics.site_update_topic(RUN, "site-a"), payload, True))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ps.fetcher.active is not None and ps.fetcher.held_bytes == 0 and ps.fetcher.active.filled == 0
    assert peak < 4 << 20, peak


def test_a_manifest_above_max_payload_is_refused_before_fetching() -> None:
    ps = _ps_channel()
    topic = topics.site_update_topic(RUN, "site-a")
    ps.accept(RawMessage(topic, _as_owner(topic, encode(_huge_manifest(MAX + 1, chunk=1 << 20))), True))
    assert not ps.fetcher.busy and ps.stats.rejected_by_site == {"site-a": {"too large": 1}}
    assert not ps.bulk.filters  # nothing subscribed


def test_the_admission_hook_refuses_a_manifest_before_any_chunk_is_asked_for() -> None:
    seen = []

    def admit(parsed, manifest):
        seen.append((parsed.site_id, manifest.round))
        return "round 1 is closed" if manifest.round == 1 else None

    ps = _ps_channel(admit_manifest=admit)
    topic = topics.site_update_topic(RUN, "site-a")
    ps.accept(RawMessage(topic, _as_owner(topic, encode(_huge_manifest(MAX // 2, chunk=1 << 16))), True))
    assert seen == [("site-a", 1)] and not ps.fetcher.busy and not ps.bulk.filters
    assert ps.stats.rejected_by_site == {"site-a": {"manifest refused": 1}}


def test_a_senders_queued_transfers_are_bounded_by_configuration() -> None:
    tight = SMALL.model_copy(update={"max_pending_chunk_bytes": MAX, "max_pending_manifests": 2,
                                     "max_payload_bytes": MAX})
    broker = MemoryBroker()
    ps = Channel(MemoryTransport(broker, tight, client_id="ps"), run_id=RUN, identity=identity(RUN, "ps"))
    ps.connect()
    update_a, report_a = topics.site_update_topic(RUN, "site-a"), topics.site_report_topic(RUN, "site-a")
    ps.accept(RawMessage(update_a, _as_owner(update_a, encode(_huge_manifest(MAX - 4096, chunk=1 << 16))), True))
    second = _huge_manifest(8192, chunk=4096).model_copy(update={"inner_kind": "eval_report",
                                                                 "transfer_id": "y" * 32})
    ps.accept(RawMessage(report_a, _as_owner(report_a, encode(second)), True))  # MAX - 4096 + 8192 > MAX
    assert ps.stats.rejected_by_site == {"site-a": {"over budget": 1}}
    # another site's budget is its own
    update_b = topics.site_update_topic(RUN, "site-b")
    ps.accept(RawMessage(update_b, _as_owner(update_b, encode(_huge_manifest(MAX, "site-b", 1 << 16))), True))
    assert "site-b" not in ps.stats.rejected_by_site and len(ps.fetcher.pending) == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False), st.integers(1500, 9000), st.floats(0, 0.3), st.floats(0, 0.3))
def test_reassembly_holds_no_more_than_the_verified_chunks(rng: random.Random, n: int, p_drop: float,
                                                           p_corrupt: float) -> None:
    """Chunks in any order, some duplicated, corrupted or dropped: the fetcher never holds more bytes than the
    distinct chunks it verified, and a transfer that completes is the sender's message, bit for bit."""
    update = _big_update(n)
    data = encode(update)
    manifest, chunks = split(data, update, chunk_bytes=SMALL.chunk_bytes)
    topic = topics.site_update_topic(RUN, "site-a")
    ps = Channel(MemoryTransport(MemoryBroker(), SMALL, client_id="ps"), run_id=RUN, identity=identity(RUN, "ps"))
    ps.accept(RawMessage(topic, _as_owner(topic, encode(manifest)), True))
    delivered: set[int] = set()
    got = None
    events = [c for c in chunks() if rng.random() >= p_drop]
    events += rng.sample(events, k=len(events) // 4)  # duplicates
    rng.shuffle(events)
    for c in events:
        if rng.random() < p_corrupt:
            c = c.model_copy(update={"data": bytes([c.data[0] ^ 1]) + c.data[1:]})
        elif ps.fetcher.active is not None:
            delivered.add(c.index)
        inbound = ps.accept(RawMessage(topics.chunk_topic(topic, c.index), encode(c), True))
        got = got or inbound
        held = ps.fetcher.held_bytes
        assert held <= sum(manifest.chunk_length(i) for i in delivered) <= manifest.total_bytes
    if got is not None:
        assert got.message == update
    assert "internal error" not in ps.stats.rejected


def test_a_transfer_trickling_slower_than_the_minimum_rate_gives_up_the_fetch_slot() -> None:
    ps = _ps_channel()
    clock = [0.0]
    ps.fetcher.clock = lambda: clock[0]
    update = _big_update(20_000)
    manifest, chunks = split(encode(update), update, chunk_bytes=SMALL.chunk_bytes)
    topic = topics.site_update_topic(RUN, "site-a")
    ps.accept(RawMessage(topic, _as_owner(topic, encode(manifest)), True))
    limit = ps.fetcher.active.deadline
    for c in list(chunks())[:-1]:  # every chunk but the last, each just before the stall timer fires
        clock[0] += SMALL.chunk_stall_s * 0.9
        ps.accept(RawMessage(topics.chunk_topic(topic, c.index), encode(c), True))
        ps._report(ps.fetcher.tick())
        if clock[0] > limit:
            break
    assert clock[0] > limit and not ps.fetcher.busy
    assert ps.stats.rejected_by_site == {"site-a": {"chunked transfer failed": 1}}
