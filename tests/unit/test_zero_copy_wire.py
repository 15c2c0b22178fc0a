"""A large model crosses the wire without copies: the view reader gives exactly what msgpack gives (tensor bytes as
views of the payload), a chunked message is reassembled in place and cut from its encoding's pieces, and the
resident memory of a receive stays near one model, not three."""

from __future__ import annotations

import mmap
from pathlib import Path

import msgpack
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from signed_wire import identity

from fedmqtt.transport import topics
from fedmqtt.transport.bulk import split
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.memory import SIMULATION_SETTINGS, MemoryBroker, MemoryTransport
from schemas import messages as m
from schemas.codec import decode, encode, encode_pieces
from schemas.msgpack_views import unpack_with_views
from schemas.tensors import arrays_to_blobs, tensors_hash

LIMITS = {"max_bin_len": 1 << 30, "max_str_len": 1 << 20, "max_array_len": 1000, "max_map_len": 1000,
          "max_containers": 1000, "max_depth": 8}
MiB = 1 << 20


def _unpackb(data: bytes) -> object:
    return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=LIMITS["max_bin_len"],
                           max_str_len=LIMITS["max_str_len"], max_array_len=LIMITS["max_array_len"],
                           max_map_len=LIMITS["max_map_len"], max_ext_len=0)


def _plain(obj: object) -> object:
    """Views as bytes, for comparing with what unpackb gives."""
    if isinstance(obj, memoryview):
        return bytes(obj)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
           | st.text(max_size=40) | st.binary(max_size=40)
           | st.builds(lambda n, b: bytes([b]) * n, st.integers(1 << 16, (1 << 16) + 8), st.integers(0, 255)))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.sampled_from(["data", "name", "x"]) | st.text(max_size=8), inner,
                                        max_size=5), max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(VALUES)
def test_the_view_reader_gives_what_unpackb_gives(obj: object) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    got = unpack_with_views(data, **LIMITS, min_view=1 << 16)
    if got is None:  # given up (only for what it does not take, e.g. nesting beyond the bound): unpackb decides
        return
    assert _plain(got) == _unpackb(data)


@settings(max_examples=200, deadline=None)
@given(VALUES, st.data())
def test_the_view_reader_never_takes_what_unpackb_refuses(obj: object, draw: st.DataObject) -> None:
    """A damaged payload (bytes flipped, cut or appended): the reader gives up or gives unpackb's own result."""
    data = bytearray(msgpack.packb(obj, use_bin_type=True))
    for _ in range(draw.draw(st.integers(1, 3))):
        at = draw.draw(st.integers(0, len(data) - 1))
        data[at] = draw.draw(st.integers(0, 255))
    data = data[: draw.draw(st.integers(0, len(data)))] + draw.draw(st.binary(max_size=3))
    got = unpack_with_views(bytes(data), **LIMITS)
    try:
        expected = _unpackb(bytes(data))
    except Exception:  # noqa: BLE001 - whatever unpackb refuses, the reader must not accept
        assert got is None
        return
    if got is not None:
        assert _plain(got) == expected


def test_only_large_data_bins_are_views_and_they_alias_the_payload() -> None:
    big = bytes(range(256)) * 512  # 128 KiB
    payload = msgpack.packb({"data": big, "other": big, "small": {"data": b"xy"}}, use_bin_type=True)
    got = unpack_with_views(payload, **LIMITS)
    assert isinstance(got, dict)
    assert isinstance(got["data"], memoryview) and got["data"].readonly and got["data"].obj is payload
    assert type(got["other"]) is bytes and type(got["small"]["data"]) is bytes
    assert got["data"] == big


def test_a_decoded_large_model_holds_views_of_its_payload() -> None:
    # Prepare: a 4 MB model, over the size from which tensors stay in the payload
    rng = np.random.default_rng(0)
    blobs = arrays_to_blobs({"w": rng.normal(size=1_000_000).astype(np.float32), "b": np.ones(3, np.float32)})
    message = m.GlobalModel(run_id="r", sender="ps", round=1, model=m.ModelSpec(name="mlp"),
                            model_hash=tensors_hash(blobs), tensors=blobs)
    payload = encode(message, max_bytes=64 * MiB)
    # Execute
    got = decode(payload, max_bytes=64 * MiB)
    # Assert: equal, the large tensor a read-only view of the payload, never writable through it
    assert got == message
    array = {b.name: b for b in got.tensors}["w"].to_numpy()
    assert np.shares_memory(array, np.frombuffer(payload, np.uint8)) and not array.flags.writeable


def test_a_message_cut_from_its_pieces_is_the_message_cut_from_its_encoding() -> None:
    # Prepare: tensors of sizes that put chunk boundaries inside and across pieces
    rng = np.random.default_rng(1)
    arrays = {"a": rng.normal(size=70_000).astype(np.float32), "b": rng.normal(size=33).astype(np.float32),
              "c": rng.normal(size=50_000).astype(np.float32)}
    blobs = arrays_to_blobs(arrays)
    message = m.GlobalModel(run_id="r", sender="ps", round=1, model=m.ModelSpec(name="mlp"),
                            model_hash=tensors_hash(blobs), tensors=blobs, msg_id="m" * 32)
    pieces = encode_pieces(message, max_bytes=64 * MiB)
    # Execute
    from_pieces, chunks = split(pieces, message, chunk_bytes=65_536)
    whole, whole_chunks = split(encode(message, max_bytes=64 * MiB), message, chunk_bytes=65_536)
    # Assert: the same manifest and chunks; a chunk inside a tensor is that tensor's memory, not a copy
    same = ("total_bytes", "chunk_bytes", "chunk_sha256", "root_sha256", "tensor_index", "transfer_id")
    assert len(pieces) > 1 and all(getattr(from_pieces, f) == getattr(whole, f) for f in same)
    cut = list(chunks())
    assert [c.data for c in cut] == [c.data for c in whole_chunks()]
    inside = [c.data for c in cut if isinstance(c.data, memoryview)]
    assert inside and any(np.shares_memory(np.frombuffer(v, np.uint8), arrays["a"]) for v in inside)


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def test_a_chunked_model_is_received_in_place_in_about_its_own_size_of_memory() -> None:
    # Prepare: a 64 MiB model retained as 1 MiB chunks at the in-process broker; the PS's channel receives it
    settings_ = SIMULATION_SETTINGS.model_copy(update={
        "chunk_threshold_bytes": 2 * MiB, "chunk_bytes": MiB, "fetch_window_bytes": 8 * MiB,
        "max_payload_bytes": 256 * MiB})
    broker = MemoryBroker()

    def factory(**kw):  # noqa: ANN003, ANN202
        return MemoryTransport(broker, settings_, **kw)

    run = "run-1"
    ps = Channel.open(factory, client_id="ps", will=None, run_id=run, identity=identity(run, "ps"))
    site = Channel.open(factory, client_id="site", will=None, run_id=run, identity=identity(run, "site-a"))
    for ch in (ps, site):
        ch.connect()
    model_mib = 64
    weights = np.random.default_rng(2).normal(size=model_mib * MiB // 4).astype(np.float32)
    blobs = arrays_to_blobs({"w": weights})
    site.transport.subscribe([topics.ps_model_topic(run)])
    ps.send(topics.ps_model_topic(run), m.GlobalModel(run_id=run, sender="ps", round=1,
                                                      model=m.ModelSpec(name="mlp"), model_hash=tensors_hash(blobs),
                                                      tensors=blobs))
    del blobs
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current RSS
    before = _status_mib("VmRSS")
    # Execute
    got = None
    for _ in range(2000):
        got = site.receive(0.05)
        if got is not None:
            break
    peak = _status_mib("VmHWM")
    # Assert: the same weights, viewed in the transfer's own map; a peak of one model plus chunk buffers (the
    # chunks joined and then decoded, as before, held about three)
    assert got is not None
    data = got.message.tensors[0].data
    assert isinstance(data, memoryview) and isinstance(data.obj, mmap.mmap) and data.readonly
    assert np.array_equal(got.message.tensors[0].to_numpy(), weights)
    assert peak - before < 1.5 * model_mib, f"receiving peaked {peak - before:.0f} MiB above the start"
    for ch in (ps, site):
        ch.close()


def test_encoding_a_message_as_pieces_leaves_no_cycle_that_keeps_its_arrays() -> None:
    """The pieces reference the model's arrays; once they are dropped the arrays must go at once, not when the
    cycle collector next runs (a PS held a whole extra model between rounds that way)."""
    import gc
    import weakref

    gc.disable()
    try:
        # Prepare
        array = np.ones(100_000, np.float32)
        gone = weakref.ref(array)
        blobs = arrays_to_blobs({"w": array})
        message = m.GlobalModel(run_id="r", sender="ps", round=1, model=m.ModelSpec(name="mlp"),
                                model_hash=tensors_hash(blobs), tensors=blobs)
        # Execute
        pieces = encode_pieces(message, max_bytes=64 * MiB)
        assert any(isinstance(p, memoryview) for p in pieces)
        del array, blobs, message, pieces
        # Assert
        assert gone() is None
    finally:
        gc.enable()


def test_an_update_stored_and_sent_as_pieces_is_byte_for_byte_the_update_stored_and_sent_joined(tmp_path) -> None:
    """A site stores and publishes its update from the pieces of its encoding (no model-sized join): the file and
    the chunks at the broker hold exactly the bytes of `encode(update)`, and the receiver decodes the same update.
    A chunk altered at the broker is still refused by its digest."""
    from schemas.envelope import unseal
    from site_agent.store import UplinkStore

    # Prepare: an update big enough to travel as chunks, with chunk boundaries inside and across tensors
    settings_ = SIMULATION_SETTINGS.model_copy(update={
        "chunk_threshold_bytes": 64 * 1024, "chunk_bytes": 65_536, "fetch_window_bytes": 1 * MiB,
        "chunk_refetches": 0, "max_payload_bytes": 16 * MiB})
    run = "run-1"
    rng = np.random.default_rng(4)
    update = m.ClientUpdate(run_id=run, sender="site-a", round=3, session="ab", base_model_hash="0" * 64,
                            tensors=arrays_to_blobs({"a": rng.normal(size=70_000).astype(np.float32),
                                                     "b": rng.normal(size=33).astype(np.float32),
                                                     "c": rng.normal(size=50_000).astype(np.float32)}),
                            n_samples=10, local_steps=2)
    joined = encode(update, max_bytes=16 * MiB)
    pieces = encode_pieces(update, max_bytes=16 * MiB)
    assert len(pieces) > 1 and any(isinstance(p, memoryview) for p in pieces)
    # Execute: store both ways; send the pieces to the PS over the in-process broker
    store = UplinkStore(tmp_path / "uplink")
    from_pieces = store.save("update", 3, "f" * 64, pieces).read_bytes()
    from_bytes = store.save("update", 4, "f" * 64, joined).read_bytes()
    broker = MemoryBroker()

    def factory(**kw):  # noqa: ANN003, ANN202
        return MemoryTransport(broker, settings_, **kw)

    ps = Channel.open(factory, client_id="ps", will=None, run_id=run, identity=identity(run, "ps"))
    site = Channel.open(factory, client_id="site", will=None, run_id=run, identity=identity(run, "site-a"))
    for ch in (ps, site):
        ch.connect()
    topic = topics.site_update_topic(run, "site-a")
    site.send(topic, update, payload=pieces)
    chunk_topics = sorted((t for t in broker.retained if t.startswith(topic + "/chunk/")),
                          key=lambda t: int(t.rsplit("/", 1)[1]))
    sent = b"".join(bytes(decode(broker.retained[t], max_bytes=16 * MiB).data) for t in chunk_topics)
    ps.transport.subscribe([topic])
    got = None
    for _ in range(200):
        got = got or ps.receive(0)
    # Assert: the same bytes everywhere, and the same update at the receiver
    assert from_pieces == from_bytes == joined == sent
    assert got is not None and encode(got.message, max_bytes=16 * MiB) == joined
    # A chunk altered at the broker (one byte of a tensor) fails its digest: the transfer is refused
    manifest = decode(unseal(broker.retained[topic], max_bytes=16 * MiB)[1], max_bytes=16 * MiB)
    chunk = decode(broker.retained[chunk_topics[1]], max_bytes=16 * MiB)
    bad = bytearray(chunk.data)
    bad[100] ^= 1
    broker.retained[chunk_topics[1]] = encode(chunk.model_copy(update={"data": bytes(bad)}), max_bytes=16 * MiB)
    receiver = Channel.open(factory, client_id="ps2", will=None, run_id=run, identity=identity(run, "ps"))
    receiver.connect()
    receiver.transport.subscribe([topic])
    assert manifest.count == len(chunk_topics) and [receiver.receive(0) for _ in range(200)] == [None] * 200
    assert receiver.stats.rejected["chunked transfer failed"] == 1 and receiver.fetcher.stats.corrupt >= 1
    for ch in (ps, site, receiver):
        ch.close()
