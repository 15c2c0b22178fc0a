"""Wire codec: a round trip for every message kind, the rejections, tensor blobs and the privacy rule."""

from __future__ import annotations

import json
import typing

import msgpack
import numpy as np
import pytest
from feature_examples import feature_examples
from pydantic import BaseModel, ValidationError
from secagg_examples import secagg_examples

from fedmqtt.errors import SchemaError
from schemas import messages as m
from schemas.chunks import Chunk, ChunkManifest, TensorEntry, chunk_digest, root_digest
from schemas.codec import decode, encode, json_schemas, pack
from schemas.messages import TEXT_KINDS
from schemas.signed import KeyList, PartyKey
from schemas.tensors import TensorBlob, arrays_to_blobs, blobs_to_arrays, tensors_hash

RUN = "r1"


def _weights() -> dict[str, np.ndarray]:
    return {
        "fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
        "fc.bias": np.array([0.5, -1.25], dtype=np.float32),
        "bn.num_batches_tracked": np.array(12, dtype=np.int64),
    }


def _blob(dtype: str = "float32", shape: tuple[int, ...] = (2,), data: bytes | None = None) -> dict:
    """A TensorBlob as a plain dict (how it looks after msgpack), for building bad payloads."""
    if data is None:
        data = np.zeros(shape, dtype=np.float32).tobytes()
    return {"name": "w", "dtype": dtype, "shape": list(shape), "data": data}


def _all_messages() -> list[BaseModel]:
    """One instance of every kind in `schemas.messages.Message`, with the optional parts filled in."""
    blobs = arrays_to_blobs(_weights())
    spec = m.ModelSpec(name="mlp", args={"hidden": [16, 8], "norm": "bn", "dropout": 0.1})
    return [
        m.GlobalModel(run_id=RUN, sender="ps", round=1, model=spec, model_hash="h" * 64, tensors=blobs),
        m.TrainTask(
            run_id=RUN,
            sender="ps",
            round=2,
            site_id="site-a",
            model_hash="h" * 64,
            deadline=1234.5,
            settings=m.TrainSettings(epochs=2, lr=0.01, optimizer="sgd", hyper={"mu": 0.01}),
            accepted_round=1,
        ),
        m.EvalTask(run_id=RUN, sender="ps", round=3, site_id="site-b", model_hash="h" * 64, splits=("test",)),
        m.RecruitmentResult(run_id=RUN, sender="ps", round=0, site_id="site-b", recruited=False, score=0.98,
                            rank=4, candidates=4, detail="not recruited: score 0.9843, rank 4 of 4"),
        m.UploadTurn(run_id=RUN, sender="ps", round=3, site_id="site-b", session="0a1b2c3d4e5f6071",
                     grant=1_764_000_000_123),
        m.ClientUpdate(
            run_id=RUN,
            sender="site-a",
            round=1,
            base_model_hash="h" * 64,
            tensors=blobs,
            n_samples=120,
            local_steps=8,
            train_loss=0.42,
            val_metrics={"auroc": 0.8, "auprc": None},
            undefined={"auprc": "only one class"},
            control_variates=arrays_to_blobs({"c": np.ones(3, np.float32)}),
            label_histogram={"0": 70, "1": 50},
            compute_seconds=1.5,
            usage=m.ResourceUsage(device="cuda:0", wall_s=1.5, cpu_s=1.2, energy_j=310.5, gpu_util_pct=87.0,
                                  gpu_peak_mem_mb=812.0, amp="bfloat16"),
        ),
        m.EvalReport(
            run_id=RUN,
            sender="site-a",
            round=3,
            model_hash="h" * 64,
            tag="final",
            metrics={"val": {"auroc": None, "accuracy": 0.75}, "test": {"auroc": None, "loss": None}},
            n_samples={"val": 20, "test": 21},
            undefined={"val.auroc": "only one class (negative) in this split"},
        ),
        m.SiteStatus(
            run_id=RUN,
            sender="site-a",
            round=0,
            state="online",
            n_train=100,
            n_val=20,
            n_test=21,
            label_histogram={"0": 60, "1": 40},
            version="0.1.0",
        ),
        m.DaemonStatus(
            run_id=RUN,
            sender="ps",
            round=2,
            state="training",
            algorithm="fedavg",
            rounds_total=5,
            sites_expected=("site-a", "site-b"),
            sites_online=("site-a",),
            waiting_for=("site-b",),
            deadline=99.5,
            detail="round 2: 1/2 updates",
        ),
        m.RoundMetrics(
            run_id=RUN,
            sender="ps",
            round=2,
            sites=("site-a", "site-b"),
            stragglers=("site-c",),
            per_site={"site-a": {"auroc": 0.8}, "site-b": {"auroc": None}},
            mean={"auroc": 0.8},
            train_loss=0.3,
            duration_s=4.25,
        ),
        _manifest(),
        Chunk(run_id=RUN, sender="ps", round=1, transfer_id="t" * 32, index=0, data=b"\x01" * 2048),
        KeyList(run_id=RUN, sender="coordinator", round=0, version=3,
                keys={"ps": PartyKey(ed25519="A" * 43), "site-a": PartyKey(ed25519="b-_" * 14 + "c")}),
        *secagg_examples(RUN),
        *feature_examples(RUN),
    ]


def _manifest() -> ChunkManifest:
    digests = (chunk_digest(b"\x01" * 2048), chunk_digest(b"\x02" * 100))
    return ChunkManifest(run_id=RUN, sender="ps", round=1, inner_kind="global_model", transfer_id="t" * 32,
                         total_bytes=2148, chunk_bytes=2048, chunk_sha256=digests, root_sha256=root_digest(digests),
                         tensor_index=(TensorEntry(name="fc.weight", dtype="float32", shape=(2, 3)),))


def _valid_update_dict() -> dict:
    """A ClientUpdate as the plain dict msgpack would carry, for tampering with single fields."""
    message = next(x for x in _all_messages() if x.kind == "client_update")
    return message.model_dump(mode="python")


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _message_kinds() -> set[str]:
    union = typing.get_args(typing.get_args(m.Message)[0])
    return {cls.model_fields["kind"].default for cls in union}


ALL = _all_messages()


def test_examples_cover_every_kind() -> None:
    """The round-trip table below has one message of every kind in `Message`."""
    assert {msg.kind for msg in ALL} == _message_kinds()


@pytest.mark.parametrize("message", ALL, ids=lambda msg: msg.kind)
def test_round_trip_equals(message: BaseModel) -> None:
    """encode -> decode gives back an equal message, for every kind."""
    # Execute
    data = encode(message)
    back = decode(data)
    # Assert
    assert type(back) is type(message)
    assert back == message


@pytest.mark.parametrize("message", ALL, ids=lambda msg: msg.kind)
def test_observer_kinds_are_json_and_the_rest_msgpack(message: BaseModel) -> None:
    """site_status, daemon_status, round_metrics and key_list are JSON text; tensor-carrying kinds are msgpack."""
    data = encode(message)
    if message.kind in {"site_status", "daemon_status", "round_metrics", "key_list", "feature_statistics"}:
        assert data[:1] == b"{"
        assert json.loads(data.decode("utf-8"))["kind"] == message.kind
    else:
        assert data[:1] != b"{"
        assert msgpack.unpackb(data, raw=False)["kind"] == message.kind


def test_text_kinds_constant_matches_the_observer_kinds() -> None:
    """TEXT_KINDS names exactly the three observer-facing kinds, the key list (observers verify with it) and the
    federation's feature statistics (observers and people read them)."""
    assert TEXT_KINDS == {"site_status", "daemon_status", "round_metrics", "key_list", "feature_statistics"}


def test_tensors_survive_the_round_trip_bit_identical() -> None:
    """Tensor values, dtypes and shapes (a 0-d int64 included) come back unchanged."""
    update = next(x for x in ALL if x.kind == "client_update")
    back = decode(encode(update))
    arrays = blobs_to_arrays(back.tensors)
    for name, expected in _weights().items():
        assert arrays[name].dtype == expected.dtype
        assert arrays[name].shape == expected.shape
        np.testing.assert_array_equal(arrays[name], expected)


def _with(**changes: object) -> bytes:
    obj = _valid_update_dict()
    obj.update(changes)
    return _pack(obj)


def _nan_blob() -> dict:
    return _blob(data=np.array([1.0, np.nan], dtype=np.float32).tobytes())


def _inf_blob() -> dict:
    return _blob(data=np.array([np.inf, 0.0], dtype=np.float32).tobytes())


REJECTIONS = [
    pytest.param(b"\xc1\xc1\xc1", "malformed payload", id="malformed-msgpack"),
    pytest.param(b"\x92\x01", "malformed", id="truncated-msgpack"),
    pytest.param(b"{not json", "malformed", id="malformed-json"),
    pytest.param(b"", "empty payload", id="empty"),
    pytest.param(_pack([1, 2, 3]), "expected a map", id="list-not-map"),
    pytest.param(_pack(7), "expected a map", id="int-not-map"),
    pytest.param(_with(schema_version=2), "schema_version 2", id="schema-version-2"),
    pytest.param(
        _pack({k: v for k, v in _valid_update_dict().items() if k != "schema_version"}),
        "schema_version None",
        id="schema-version-missing",
    ),
    pytest.param(_with(kind="weights_dump"), "weights_dump", id="unknown-kind"),
    pytest.param(_with(patient_ids=["p1"]), "patient_ids: Extra inputs", id="extra-field"),
    pytest.param(_with(tensors=[_nan_blob()]), "NaN or Inf", id="nan"),
    pytest.param(_with(tensors=[_inf_blob()]), "NaN or Inf", id="inf"),
    pytest.param(_with(tensors=[_blob(shape=(3,), data=b"\x00" * 8)]), "needs 12", id="bytes-vs-shape"),
    pytest.param(
        _with(tensors=[_blob(dtype="object", data=b"\x00" * 16)]), "tensors.0.dtype", id="object-dtype"
    ),
    pytest.param(
        _with(tensors=[_blob(dtype="complex64", data=b"\x00" * 16)]), "tensors.0.dtype", id="complex64-dtype"
    ),
    pytest.param(_with(n_samples=-1), "n_samples", id="negative-count"),
]


@pytest.mark.parametrize(("payload", "needle"), REJECTIONS)
def test_decode_rejects_with_a_message_naming_the_problem(payload: bytes, needle: str) -> None:
    """Every bad payload raises SchemaError, and the message names what is wrong."""
    with pytest.raises(SchemaError) as info:
        decode(payload)
    assert needle in str(info.value)


def test_decode_rejects_payload_over_max_bytes() -> None:
    """A payload above `max_bytes` is refused before it is parsed."""
    data = encode(ALL[0])
    with pytest.raises(SchemaError, match=r"exceeds the budget of 100 bytes"):
        decode(data, max_bytes=100)
    assert decode(data, max_bytes=len(data)) == ALL[0]


def test_encode_refuses_to_produce_more_than_max_bytes() -> None:
    """encode raises SchemaError instead of producing a payload the broker would drop."""
    big = m.GlobalModel(
        run_id=RUN,
        sender="ps",
        round=1,
        model=m.ModelSpec(name="mlp"),
        model_hash="h",
        tensors=arrays_to_blobs({"w": np.zeros(1000, np.float32)}),
    )
    with pytest.raises(SchemaError, match=r"global_model of \d+ bytes exceeds the budget of 1024 bytes"):
        encode(big, max_bytes=1024)


def test_tensor_blob_rejects_numpy_dtypes_not_on_the_wire() -> None:
    """from_numpy refuses complex and object arrays."""
    with pytest.raises(ValueError, match="complex64"):
        TensorBlob.from_numpy("w", np.zeros(2, np.complex64))
    with pytest.raises(ValueError, match="object"):
        TensorBlob.from_numpy("w", np.array([None, 1], dtype=object))


def test_to_numpy_is_a_zero_copy_read_only_view() -> None:
    """to_numpy shares memory with the blob's bytes and cannot be written through."""
    # Prepare
    blob = TensorBlob.from_numpy("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    # Execute
    array = blob.to_numpy()
    # Assert
    assert np.shares_memory(array, np.frombuffer(blob.data, dtype=np.uint8))
    assert not array.flags.writeable
    assert array.shape == (3, 4)


def test_arrays_to_blobs_is_sorted_by_name() -> None:
    """Blobs come out in name order whatever the dict order, so equal weights give equal bytes."""
    arrays = {"z": np.zeros(1, np.float32), "a": np.ones(2, np.float32), "m.bias": np.zeros(3, np.float32)}
    blobs = arrays_to_blobs(arrays)
    assert [b.name for b in blobs] == ["a", "m.bias", "z"]
    reversed_dict = dict(reversed(list(arrays.items())))
    assert arrays_to_blobs(reversed_dict) == blobs


def test_tensors_hash_ignores_order_and_sees_one_changed_byte() -> None:
    """The hash is the same in any blob order and differs when a single byte differs."""
    # Prepare
    blobs = arrays_to_blobs(_weights())
    first = blobs[0]
    flipped = bytearray(first.data)
    flipped[0] ^= 0x01
    changed = (
        TensorBlob(name=first.name, dtype=first.dtype, shape=first.shape, data=bytes(flipped)),
        *blobs[1:],
    )
    # Execute / Assert
    assert tensors_hash(blobs) == tensors_hash(tuple(reversed(blobs)))
    assert tensors_hash(changed) != tensors_hash(blobs)
    assert len(tensors_hash(blobs)) == 64


def test_blobs_to_arrays_rejects_a_repeated_name() -> None:
    """Two blobs with one name are an error, not a silent overwrite."""
    blob = TensorBlob.from_numpy("w", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="appears twice"):
        blobs_to_arrays([blob, blob])


def test_json_schemas_contains_every_kind() -> None:
    """json_schemas() maps every kind to a schema."""
    schema = json_schemas()
    assert set(schema["discriminator"]["mapping"]) == _message_kinds()
    defs = schema["$defs"]
    for name in (
        "GlobalModel",
        "TrainTask",
        "EvalTask",
        "ClientUpdate",
        "EvalReport",
        "SiteStatus",
        "DaemonStatus",
        "RoundMetrics",
    ):
        assert name in defs


# Field names that would suggest patient-level data; only weights, counts and aggregates may travel.
FORBIDDEN = {
    "patient",
    "patients",
    "record",
    "records",
    "row",
    "rows",
    "x",
    "features",
    "feature",
    "labels",
    "image",
    "images",
    "raw",
    "raw_data",
    "inputs",
    "targets",
    "y",
}
# A site's privacy-policy rules travel in its status under the names of its config's [privacy] keys: a threshold on
# a count and a flag, never data. Named one by one, so any other field with these words still fails.
POLICY_RULE_FIELDS = {"PrivacyPolicy.min_records_per_update", "PrivacyPolicy.require_record_dp"}


def _nested_models(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _nested_models(arg)]


def _all_field_names() -> dict[str, set[str]]:
    """Every field name of every message model, recursively through nested models."""
    seen: dict[str, set[str]] = {}
    todo = list(typing.get_args(typing.get_args(m.Message)[0]))
    while todo:
        model = todo.pop()
        if model.__name__ in seen:
            continue
        seen[model.__name__] = set(model.model_fields)
        for field in model.model_fields.values():
            todo.extend(_nested_models(field.annotation))
    return seen


def test_no_message_field_suggests_patient_level_data() -> None:
    """No field of any message (nested models included) is named like patient-level data."""
    # Execute
    fields = _all_field_names()
    # Assert
    assert {"TensorBlob", "ModelSpec", "TrainSettings"} <= set(fields)  # the walk reached nested models
    offending = sorted(
        f"{model}.{name}"
        for model, names in fields.items()
        for name in names
        if (name in FORBIDDEN or set(name.split("_")) & FORBIDDEN) and f"{model}.{name}" not in POLICY_RULE_FIELDS
    )
    assert offending == []


def test_fast_pack_is_byte_identical_to_msgpack() -> None:
    """`pack` copies large blobs once instead of growing a buffer; the bytes must be exactly packb's."""
    from schemas.codec import pack, pack_pieces

    blobs = arrays_to_blobs({"big": np.arange(70_000, dtype=np.float32), "edge": np.ones(16_384, np.float32),
                             "below": np.ones(16_383, np.float32), "empty": np.zeros((0,), np.float32)})
    big = m.GlobalModel(run_id=RUN, sender="ps", round=1, model=m.ModelSpec(name="mlp"), model_hash="h" * 64,
                        tensors=blobs, extras={"c": blobs})
    for message in [*ALL, big]:
        dumped = message.model_dump(mode="python")
        assert pack(dumped) == msgpack.packb(dumped, use_bin_type=True), message.kind
        assert b"".join(pack_pieces(dumped)) == pack(dumped), message.kind
    assert decode(encode(big)) == big


def test_blobs_made_from_arrays_alias_them_and_encode_the_same() -> None:
    """from_numpy keeps a read-only view of the array (a 1 GB model is not copied to build a message); the
    encoding is the one a copy of the bytes gives, and the large blob is one of pack_pieces' pieces uncopied."""
    from schemas.codec import pack_pieces

    array = np.arange(40_000, dtype=np.float32).reshape(200, 200)
    blob = TensorBlob.from_numpy("w", array)
    assert isinstance(blob.data, memoryview) and blob.data.readonly
    assert np.shares_memory(np.frombuffer(blob.data, np.uint8), array)
    copied = TensorBlob(name="w", dtype="float32", shape=(200, 200), data=array.tobytes())
    assert isinstance(copied.data, bytes) and copied == blob
    assert pack(blob.model_dump(mode="python")) == pack(copied.model_dump(mode="python"))
    pieces = pack_pieces(blob.model_dump(mode="python"))
    assert any(piece is blob.data for piece in pieces)
    strided = TensorBlob.from_numpy("w", array.T)  # not contiguous: the one case that copies
    assert not np.shares_memory(np.frombuffer(strided.data, np.uint8), array)
    assert np.array_equal(strided.to_numpy(), array.T)
    with pytest.raises(ValidationError, match="NaN or Inf"):
        TensorBlob.from_numpy("w", np.array([1.0, np.nan], np.float32))
