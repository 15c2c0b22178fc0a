"""Chunked transfer over the in-process broker: reassembly, and every way a chunk can go wrong.

The real-Mosquitto side (ACL, a real intruder, a real federation) is in tests/integration and tests/e2e;
here the fetcher's clock is driven by hand so stalls need no sleeping.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from signed_wire import identity, signed

from fedmqtt.errors import TopicError
from fedmqtt.transport import topics
from fedmqtt.transport.bulk import REASSEMBLY_MAPS, ReassemblyMaps, reassembly_buffer, split
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.memory import SIMULATION_SETTINGS, MemoryBroker, MemoryTransport
from schemas import messages as m
from schemas.chunks import MAX_CHUNKED_BYTES, MAX_CHUNKS, Chunk, ChunkManifest, chunk_digest, root_digest
from schemas.codec import WireError, decode, encode
from schemas.envelope import unseal
from schemas.tensors import arrays_to_blobs, tensors_hash

RUN = "run-1"
CHUNK = 1024
SETTINGS = SIMULATION_SETTINGS.model_copy(update={
    "chunk_threshold_bytes": 2048, "chunk_bytes": CHUNK, "fetch_window_bytes": 4 * CHUNK,
    "chunk_stall_s": 5.0, "chunk_refetches": 2, "max_payload_bytes": 1 << 20})
MODEL_TOPIC = topics.ps_model_topic(RUN)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _model(round_no: int = 1, n: int = 5000, seed: int = 0) -> m.GlobalModel:
    rng = np.random.default_rng(seed)
    blobs = arrays_to_blobs({"fc.weight": rng.normal(size=(n,)).astype(np.float32),
                             "fc.bias": rng.normal(size=(7,)).astype(np.float32)})
    return m.GlobalModel(run_id=RUN, sender="ps", round=round_no, model=m.ModelSpec(name="mlp"),
                         model_hash=tensors_hash(blobs), tensors=blobs)


def _pair(broker: MemoryBroker, clock: Clock | None = None) -> tuple[Channel, Channel]:
    """The PS's channel and a site's, each with a control and a bulk connection."""
    def factory(**kw):
        return MemoryTransport(broker, SETTINGS, **kw)

    ps = Channel.open(factory, client_id="ps", will=None, run_id=RUN, identity=identity(RUN, "ps"))
    site = Channel.open(factory, client_id="site", will=None, run_id=RUN, identity=identity(RUN, "site-a"))
    for ch in (ps, site):
        ch.connect()
        if clock is not None:
            ch.fetcher.clock = clock
    return ps, site


def _opened(payload: bytes):  # noqa: ANN202
    """A retained (signed) message or manifest, decoded after taking its signature off."""
    return decode(unseal(payload, max_bytes=1 << 20)[1], max_bytes=1 << 20)


def _drain(channel: Channel, polls: int = 400) -> list:
    out = []
    for _ in range(polls):
        inbound = channel.receive(0)
        if inbound is not None:
            out.append(inbound.message)
    return out


def _chunk_topics(broker: MemoryBroker) -> list[str]:
    return sorted(t for t in broker.retained if "/chunk/" in t)


def test_large_model_crosses_as_chunks_and_arrives_bit_identical() -> None:
    # Prepare
    broker = MemoryBroker()
    ps, site = _pair(broker)
    model = _model()
    size = len(encode(model))
    # Execute
    site.transport.subscribe([MODEL_TOPIC])
    sent = ps.send(MODEL_TOPIC, model)
    got = _drain(site)
    # Assert: one message, same bytes; chunks retained; on-wire overhead small
    assert len(got) == 1 and encode(got[0]) == encode(model)
    assert len(_chunk_topics(broker)) == math.ceil(size / CHUNK)
    assert isinstance(_opened(broker.retained[MODEL_TOPIC]), ChunkManifest)  # one signature per transfer
    assert size < sent < size * 1.35  # ~200 B of header per 1 KiB chunk here; 0.01% at the default 2 MiB
    assert site.fetcher.stats.completed == 1 and site.fetcher.stats.failed == 0
    assert not [f for f in site.bulk.filters if "/chunk/" in f]  # every chunk subscription was dropped


def test_small_messages_are_not_chunked() -> None:
    broker = MemoryBroker()
    ps, _ = _pair(broker)
    ps.send(MODEL_TOPIC, _model(n=10))
    assert _chunk_topics(broker) == []
    assert isinstance(_opened(broker.retained[MODEL_TOPIC]), m.GlobalModel)


def test_the_fetch_window_bounds_the_chunks_asked_for_at_once() -> None:
    """The broker never has more than a window of chunks queued for one receiver (Mosquitto drops past
    max_queued_bytes): the fetcher subscribes to at most window = fetch_window_bytes / chunk_bytes topics."""
    broker = MemoryBroker()
    ps, site = _pair(broker)
    ps.send(MODEL_TOPIC, _model())
    subscribed_at_once: list[int] = []
    original = site.bulk.subscribe

    def counting(filters):
        original(filters)
        subscribed_at_once.append(len([f for f in site.bulk.filters if "/chunk/" in f]))

    site.bulk.subscribe = counting
    site.transport.subscribe([MODEL_TOPIC])
    assert len(_drain(site)) == 1
    assert len(subscribed_at_once) > 2 and max(subscribed_at_once) <= 4


def test_duplicated_chunks_are_counted_and_ignored() -> None:
    broker = MemoryBroker()
    ps, site = _pair(broker)
    ps.send(MODEL_TOPIC, _model())
    site.transport.subscribe([MODEL_TOPIC])
    assert site.receive(0) is None  # the manifest: the fetch starts
    site.bulk.refetch([topics.chunk_topic(MODEL_TOPIC, 0)] * 2)  # chunk 0 twice more
    got = _drain(site)
    assert len(got) == 1 and got[0].model_hash == _model().model_hash
    assert site.fetcher.stats.duplicates >= 1


def test_corrupted_chunk_is_refetched_then_the_transfer_fails_naming_it() -> None:
    # Prepare: chunk 2 at the broker holds other bytes under the right transfer id
    broker = MemoryBroker()
    ps, site = _pair(broker)
    model = _model()
    ps.send(MODEL_TOPIC, model)
    t2 = topics.chunk_topic(MODEL_TOPIC, 2)
    good = decode(broker.retained[t2])
    broker.retained[t2] = encode(good.model_copy(update={"data": bytes(len(good.data))}))
    # Execute
    site.transport.subscribe([MODEL_TOPIC])
    got = _drain(site)
    # Assert: never a wrong model; the reason names the chunk; the fetch was retried first
    assert got == []
    assert site.stats.rejected["chunked transfer failed"] == 1
    assert site.fetcher.stats.corrupt == SETTINGS.chunk_refetches + 1
    # ...and once the sender publishes the model again, it arrives
    broker.retained[t2] = encode(good)
    site.transport.refetch([MODEL_TOPIC])
    assert [g.model_hash for g in _drain(site)] == [model.model_hash]


def test_corrupted_chunk_error_names_the_chunk(caplog) -> None:
    broker = MemoryBroker()
    ps, site = _pair(broker)
    ps.send(MODEL_TOPIC, _model())
    t1 = topics.chunk_topic(MODEL_TOPIC, 1)
    good = decode(broker.retained[t1])
    broker.retained[t1] = encode(good.model_copy(update={"data": good.data[:-1] + b"\x00"}))
    site.transport.subscribe([MODEL_TOPIC])
    _drain(site)
    assert "chunk 1 of" in caplog.text and "SHA-256" in caplog.text and "global_model from ps" in caplog.text


def test_lost_chunk_is_fetched_again_after_a_stall() -> None:
    # Prepare: chunk 3 never reached the broker (yet)
    clock = Clock()
    broker = MemoryBroker()
    ps, site = _pair(broker, clock)
    model = _model()
    ps.send(MODEL_TOPIC, model)
    t3 = topics.chunk_topic(MODEL_TOPIC, 3)
    lost = broker.retained.pop(t3)
    site.transport.subscribe([MODEL_TOPIC])
    assert _drain(site) == []
    # Execute: the sender's copy turns up; the stall timer fires a re-fetch
    broker.retained[t3] = lost
    clock.now += SETTINGS.chunk_stall_s + 0.1
    got = _drain(site)
    # Assert
    assert [g.model_hash for g in got] == [model.model_hash]
    assert site.fetcher.stats.refetches == 1


def test_missing_or_stale_chunk_fails_after_the_refetches_with_a_clear_reason(caplog) -> None:
    # Prepare: chunk 1's topic still holds the chunk of an older transfer
    clock = Clock()
    broker = MemoryBroker()
    ps, site = _pair(broker, clock)
    ps.send(MODEL_TOPIC, _model(round_no=1, seed=1))
    stale = broker.retained[topics.chunk_topic(MODEL_TOPIC, 1)]
    ps.send(MODEL_TOPIC, _model(round_no=2, seed=2))
    broker.retained[topics.chunk_topic(MODEL_TOPIC, 1)] = stale
    site.transport.subscribe([MODEL_TOPIC])
    # Execute: each stall re-fetches the stale copy; then the transfer fails
    for _ in range(SETTINGS.chunk_refetches + 1):
        assert _drain(site) == []
        clock.now += SETTINGS.chunk_stall_s + 0.1
    assert _drain(site) == []
    # Assert
    assert site.fetcher.stats.stale >= SETTINGS.chunk_refetches + 1
    assert site.stats.rejected["chunked transfer failed"] == 1
    assert "chunks [1] of" in caplog.text and "missing or stale after 2 re-fetches" in caplog.text
    assert not site.fetcher.busy


def test_a_newer_manifest_supersedes_the_transfer_in_progress() -> None:
    clock = Clock()
    broker = MemoryBroker()
    ps, site = _pair(broker, clock)
    ps.send(MODEL_TOPIC, _model(round_no=1, seed=1))
    lost = broker.retained.pop(topics.chunk_topic(MODEL_TOPIC, 0))  # round 1 stalls
    site.transport.subscribe([MODEL_TOPIC])
    assert _drain(site, 20) == []
    newer = _model(round_no=2, seed=2)
    ps.send(MODEL_TOPIC, newer)
    got = _drain(site)
    assert [g.round for g in got] == [2] and got[0].model_hash == newer.model_hash
    assert site.stats.rejected["chunked transfer failed"] == 1  # round 1, superseded
    assert lost


def test_shorter_transfer_clears_the_chunks_a_longer_one_left() -> None:
    broker = MemoryBroker()
    ps, _ = _pair(broker)
    ps.send(MODEL_TOPIC, _model(n=8000))
    long = len(_chunk_topics(broker))
    ps.send(MODEL_TOPIC, _model(n=3000))
    short = len(_chunk_topics(broker))
    ps.send(MODEL_TOPIC, _model(n=10))
    assert long > short > 0 and _chunk_topics(broker) == []


def test_manifest_over_the_budget_is_refused_before_any_download(caplog) -> None:
    broker = MemoryBroker()
    _, site = _pair(broker)
    digests = tuple(chunk_digest(b"x") for _ in range(MAX_CHUNKS))
    huge = ChunkManifest(run_id=RUN, sender="ps", round=1, inner_kind="global_model", transfer_id="t" * 32,
                         total_bytes=MAX_CHUNKS * 8 << 20, chunk_bytes=8 << 20, chunk_sha256=digests,
                         root_sha256=root_digest(digests))
    broker.retained[MODEL_TOPIC] = signed(RUN, MODEL_TOPIC, encode(huge, max_bytes=1 << 30))
    site.transport.subscribe([MODEL_TOPIC])
    assert _drain(site, 5) == []
    assert not site.fetcher.busy and "exceeds the budget" in caplog.text


def test_manifest_of_a_kind_that_does_not_belong_on_the_topic_is_refused(caplog) -> None:
    broker = MemoryBroker()
    ps, site = _pair(broker)
    update = m.ClientUpdate(run_id=RUN, sender="ps", round=1, base_model_hash="h", tensors=_model().tensors,
                            n_samples=1, local_steps=1)
    ps.send(MODEL_TOPIC, update)  # a client_update on ps/model
    site.transport.subscribe([MODEL_TOPIC])
    assert _drain(site, 5) == [] and not site.fetcher.busy
    assert "a client_update does not belong on this topic" in caplog.text


@pytest.mark.parametrize(("field", "value", "message"), [
    ("chunk_sha256", ("0" * 64,), "chunk digests"),
    ("root_sha256", "0" * 64, "root_sha256"),
    ("chunk_bytes", 10, "greater than or equal"),
])
def test_manifest_validation(field, value, message) -> None:
    digests = (chunk_digest(b"a"), chunk_digest(b"b"))
    fields = dict(run_id=RUN, sender="ps", round=1, inner_kind="global_model", transfer_id="t" * 32,
                  total_bytes=2000, chunk_bytes=1024, chunk_sha256=digests, root_sha256=root_digest(digests))
    with pytest.raises(ValueError, match=message):
        ChunkManifest(**{**fields, field: value})


def test_chunk_topics_parse_and_only_for_bulk_kinds() -> None:
    parsed = topics.parse_topic(topics.chunk_topic(topics.site_update_topic(RUN, "site-a"), 12))
    assert (parsed.kind, parsed.site_id, parsed.chunk) == ("update", "site-a", 12)
    for bad in (f"{topics.ps_status_topic(RUN)}/chunk/0", f"{MODEL_TOPIC}/chunk/01", f"{MODEL_TOPIC}/chunk/x"):
        with pytest.raises(Exception, match="chunk|never chunked"):
            topics.parse_topic(bad)


def test_chunk_on_the_wrong_index_topic_counts_as_corrupt() -> None:
    broker = MemoryBroker()
    ps, site = _pair(broker)
    ps.send(MODEL_TOPIC, _model())
    t0, t1 = topics.chunk_topic(MODEL_TOPIC, 0), topics.chunk_topic(MODEL_TOPIC, 1)
    broker.retained[t1] = broker.retained[t0]
    site.transport.subscribe([MODEL_TOPIC])
    assert _drain(site) == []
    assert site.fetcher.stats.corrupt >= 1 and isinstance(decode(broker.retained[t0]), Chunk)


def test_a_payload_needing_more_than_max_chunks_goes_in_max_chunks_larger_ones() -> None:
    """The broker grants exactly MAX_CHUNKS chunk topics per topic, so a sender never uses an index beyond them:
    a payload that would need more chunks of its configured size travels in MAX_CHUNKS larger ones."""
    # Prepare
    message = _model()
    payload = bytes(MAX_CHUNKS * CHUNK + 1)

    # Execute
    manifest, chunks = split(payload, message, chunk_bytes=CHUNK)

    # Assert
    assert manifest.count == MAX_CHUNKS and manifest.chunk_bytes == CHUNK + 1
    assert b"".join(c.data for c in chunks()) == payload
    small, _ = split(bytes(3 * CHUNK), message, chunk_bytes=CHUNK)
    assert (small.count, small.chunk_bytes) == (3, CHUNK)  # below the bound nothing changes


def test_a_payload_beyond_what_max_chunks_can_carry_is_refused_before_anything_is_cut() -> None:
    class Declared(bytes):  # only its length is read before the refusal: no gigabyte is allocated
        def __len__(self) -> int:
            return MAX_CHUNKED_BYTES + 1

    with pytest.raises(WireError, match="exceeds what one chunked transfer carries"):
        split(Declared(b"x"), _model(), chunk_bytes=CHUNK)


def test_chunk_index_beyond_max_chunks_is_not_a_protocol_topic() -> None:
    update = topics.site_update_topic(RUN, "site-a")
    assert topics.parse_topic(topics.chunk_topic(update, MAX_CHUNKS - 1)).chunk == MAX_CHUNKS - 1
    with pytest.raises(TopicError, match="bad chunk index"):
        topics.parse_topic(f"{update}/chunk/{MAX_CHUNKS}")
    with pytest.raises(TopicError, match="out of range"):
        topics.chunk_topic(update, MAX_CHUNKS)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from Linux's /proc")
def test_the_reassembly_buffer_commits_memory_only_where_verified_chunks_are_written() -> None:
    """A manifest's declared size only reserves addresses (a hostile one may claim a gigabyte and send one chunk):
    the private, huge-page map behind a transfer grows by what is written, rounded up to a huge page, and holds
    exactly the bytes written, zeros elsewhere."""
    declared = 1 << 30
    before = _resident_bytes()
    buffer = reassembly_buffer(declared)
    assert _resident_bytes() - before < 8 << 20
    chunk = np.random.default_rng(3).integers(0, 256, size=3 << 20, dtype=np.uint8).tobytes()
    start = 512 << 20
    buffer[start:start + len(chunk)] = chunk
    assert _resident_bytes() - before < len(chunk) + (12 << 20)
    assert buffer[start:start + len(chunk)] == chunk
    assert buffer[start - 4096:start] == bytes(4096) and buffer[start + len(chunk):start + len(chunk) + 4096] \
        == bytes(4096)
    view = memoryview(buffer).toreadonly()
    with pytest.raises(TypeError):
        view[0] = 1  # the payload handed on is read-only
    view.release()
    buffer.close()


def test_a_reassembly_map_is_written_over_only_once_nothing_reads_its_payload() -> None:
    """A later transfer of about the same size takes the map of a payload nobody holds any more (its pages are
    already there); while any view, array or decoded tensor of a payload lives, its map is never handed out again,
    so a payload never changes under its reader."""
    maps = ReassemblyMaps(min_bytes=1 << 20, max_bytes=8 << 20, keep_bytes=16 << 20)
    first = maps.take(3 << 20)
    first[:4] = b"abcd"
    payload = memoryview(first)[:3 << 20].toreadonly()
    tensor = np.frombuffer(payload, dtype=np.float32)[1:5]  # as a decoded model's tensors are
    del first, payload
    second = maps.take((3 << 20) + 17)  # a payload a few bytes longer: the same 2 MiB-rounded size
    assert maps.reused == 0
    second[:4] = b"wxyz"
    assert tensor.base.view(np.uint8)[:4].tobytes() == b"abcd"  # the held payload is untouched
    del second
    third = maps.take(3 << 20)
    assert maps.reused == 1 and third[:4] == b"wxyz"  # the free one, not the one `tensor` still reads
    del tensor
    assert maps.take(3 << 20)[:4] == b"abcd" and maps.reused == 2
    assert len(maps.take(9 << 20)) == 9 << 20 and maps.reused == 2  # above max_bytes: a map of its own, not kept
    assert sum(map(len, maps._maps)) <= 16 << 20


def test_transfers_in_a_row_reuse_one_map_and_arrive_bit_identical() -> None:
    broker = MemoryBroker()
    ps, site = _pair(broker)
    site.transport.subscribe([MODEL_TOPIC])
    before = REASSEMBLY_MAPS.reused
    saved = REASSEMBLY_MAPS.min_bytes
    REASSEMBLY_MAPS.min_bytes = 0  # these test models are small
    try:
        for round_no in (1, 2, 3):
            model = _model(round_no, seed=round_no)
            ps.send(MODEL_TOPIC, model)
            got = _drain(site)
            assert len(got) == 1 and encode(got[0]) == encode(model)
            del got
    finally:
        REASSEMBLY_MAPS.min_bytes = saved
    assert REASSEMBLY_MAPS.reused - before == 2


def test_a_site_s_second_transfer_takes_the_map_made_ready_at_its_first_and_no_one_else_does() -> None:
    """A site holds round r's model while round r+1's arrives, so its second transfer would fault in a fresh map:
    with `prepare_next` the first completed transfer makes one ready (pages in), held for this fetcher alone."""
    broker = MemoryBroker()
    ps, site = _pair(broker)
    site.fetcher.prepare_next = True
    site.transport.subscribe([MODEL_TOPIC])
    saved = REASSEMBLY_MAPS.min_bytes
    REASSEMBLY_MAPS.min_bytes = 0  # these test models are small
    try:
        first = _model(1, seed=1)
        ps.send(MODEL_TOPIC, first)
        (held,) = _drain(site)  # round 1's model, still held
        prepared = site.fetcher._prepared
        assert prepared is not None
        assert bytes(prepared[:len(prepared)]) == bytes(len(prepared))  # its pages written in, all zeros
        other = REASSEMBLY_MAPS.take(len(prepared))  # another receiver of the process (the PS) meanwhile
        assert other is not prepared
        second = _model(2, seed=2)
        ps.send(MODEL_TOPIC, second)
        (got,) = _drain(site)
        # Assert: round 2's payload lies in the prepared map, bit for bit; round 1's is untouched; only once
        wire = encode(second)
        assert bytes(prepared[:len(wire)]) == wire
        assert encode(got) == encode(second) and encode(held) == encode(first)
        assert site.fetcher._prepared is None and site.fetcher._prepared_once
    finally:
        REASSEMBLY_MAPS.min_bytes = saved
