"""A party holding one site's valid credentials (its broker login and its signing key) tries what crashed or
altered the federation before.

Every message below once crashed the PS, made it crash-loop on `--resume`, altered the aggregate, left files on
disk for ever or made the PS allocate a gigabyte. Now each is refused with a logged reason and counted per site in
`ps/status`, the PS survives a SIGKILL and `--resume` with the hostile messages still retained at the broker, and
the final model is bit-identical to a run in which the same party behaved.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from pathlib import Path

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from harness import CliFederation

from fedmqtt.transport import topics
from fedmqtt.transport.signing import Identity
from schemas import messages as m
from schemas.chunks import ChunkManifest, TensorEntry, root_digest
from schemas.codec import decode, encode
from schemas.tensors import TensorBlob

pytestmark = pytest.mark.slow
RUN = "e2e-hostile"
SITES = ("cleveland", "hungary")
MALLORY = "cleveland"  # its agent never runs: a client with its credentials plays it


def _publish(client: mqtt.Client, topic: str, payload: bytes, signer: Identity | None = None) -> None:
    """Publish `payload`, signed by `signer` (the credentials' own key: signing does not make content valid)."""
    info = client.publish(topic, payload if signer is None else signer.seal(topic, payload), qos=2, retain=True)
    info.wait_for_publish(10)
    assert info.is_published(), f"broker did not take {topic}"


def _retained_model(client: mqtt.Client, me: Identity) -> m.GlobalModel:
    got: list[bytes] = []
    ready = threading.Event()

    def on_message(_c, _u, msg) -> None:  # noqa: ANN001
        if msg.topic == topics.ps_model_topic(RUN) and msg.payload:
            got.append(msg.payload)
            ready.set()

    client.on_message = on_message
    client.subscribe(topics.ps_model_topic(RUN), qos=2)
    assert ready.wait(60), "no retained model"
    model = decode(me.ring.open(topics.ps_model_topic(RUN), "ps", got[-1], max_bytes=1 << 26))
    assert isinstance(model, m.GlobalModel)
    return model


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _hostile_messages(model: m.GlobalModel, good: m.ClientUpdate) -> list[tuple[str, str, bytes]]:
    """(what, topic kind, payload): each must be refused."""
    raw = good.model_dump()
    first = raw["tensors"][0]
    n = int(np.prod(first["shape"]))
    bf16 = dict(raw, msg_id=secrets.token_hex(16), tensors=[dict(first, dtype="bfloat16", data=b"\x00\x3f" * n),
                                                             *raw["tensors"][1:]])
    tripled = good.model_copy(update={"msg_id": secrets.token_hex(16), "tensors": tuple(
        TensorBlob.from_numpy(b.name, b.to_numpy() * 3) for b in good.tensors)})
    shorter_blob = TensorBlob.from_numpy(first["name"], np.zeros(max(n - 1, 1), np.float32))
    shorter = good.model_copy(update={"msg_id": secrets.token_hex(16),
                                      "tensors": (shorter_blob, *good.tensors[1:])})
    far = good.model_copy(update={"msg_id": secrets.token_hex(16), "round": 2**31})
    inf_scalar = dict(raw, msg_id=secrets.token_hex(16), compute_seconds=float("inf"))
    digests = tuple(hashlib.sha256(str(i).encode()).hexdigest() for i in range(128))
    huge = ChunkManifest(run_id=RUN, sender=MALLORY, round=1, inner_kind="client_update",
                         transfer_id=secrets.token_hex(16), total_bytes=128 * 8 * 1024 * 1024,
                         chunk_bytes=8 * 1024 * 1024, chunk_sha256=digests, root_sha256=root_digest(digests),
                         tensor_index=tuple(TensorEntry(name=b.name, dtype=b.dtype, shape=b.shape)
                                            for b in model.tensors))
    deep_json = ('{"kind":"site_status","x":' + "[" * 200_000 + "]" * 200_000 + "}").encode()
    deep_msgpack = b"\x91" * 100_000 + b"\xc0"
    return [
        ("deeply nested JSON status", "status", deep_json),
        ("bfloat16 tensor", "update", msgpack.packb(bf16, use_bin_type=True)),
        ("the real update", "update", encode(good)),  # first wins: this one is accepted
        ("duplicate with other weights", "update", encode(tripled)),
        ("duplicate with a shorter tensor", "update", encode(shorter)),
        ("update for round 2^31", "update", encode(far)),
        ("compute_seconds = inf", "update", msgpack.packb(inf_scalar, use_bin_type=True)),
        ("manifest declaring 1 GiB", "update", encode(huge)),
        ("deeply nested msgpack report", "report", deep_msgpack),
        ("the real update once more", "update", encode(good)),  # retained for the restarted PS: a replay
    ]


def _run(fed: CliFederation, paho_client, *, hostile: bool) -> dict[str, np.ndarray]:  # noqa: ANN001
    fed.start_broker()
    fed.start_ps()
    mallory = paho_client(fed.layout.settings(MALLORY))
    me = fed.layout.identity(MALLORY)
    _publish(mallory, topics.site_status_topic(RUN, MALLORY),
             encode(m.SiteStatus(run_id=RUN, sender=MALLORY, round=0, state="online", n_train=50)), me)
    fed.start_site("hungary")
    model = _retained_model(mallory, me)
    good = m.ClientUpdate(run_id=RUN, sender=MALLORY, round=1, session=model.session, base_model_hash=model.model_hash,
                          tensors=model.tensors, n_samples=50, local_steps=3, msg_id="a" * 32)
    topic = {"status": topics.site_status_topic(RUN, MALLORY), "update": topics.site_update_topic(RUN, MALLORY),
             "report": topics.site_report_topic(RUN, MALLORY)}
    if not hostile:
        _publish(mallory, topic["update"], encode(good), me)
    else:
        before = _peak_rss_mb(fed.procs["ps"].pid)
        for _what, kind, payload in _hostile_messages(model, good):
            _publish(mallory, topic[kind], payload, me)
        status = fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and sum(
            msg.rejected.get(MALLORY, {}).values()) >= 7, 60, "ps/status counting the refused messages")
        fed.check_alive()
        grown = _peak_rss_mb(fed.procs["ps"].pid) - before
        assert grown < 100, f"the PS's peak memory grew by {grown:.0f} MB from a few small messages"
        assert isinstance(status, m.DaemonStatus)
        fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and msg.round >= 2, 120, "round 1 closed")
        # A SIGKILL with every hostile message still retained at the broker: the restarted PS replays them all.
        fed.kill("ps")
        fed.start_ps(resume=True)
    fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and msg.round >= 2, 120, "round 1 closed")
    _publish(mallory, topic["status"], encode(m.SiteStatus(run_id=RUN, sender=MALLORY, round=0, state="offline")), me)
    fed.wait_ps_done(120)
    return fed.final_weights()


def test_one_sites_credentials_cannot_crash_alter_or_bloat_the_run(cli_federation, paho_client) -> None:  # noqa: ANN001
    clean = _run(cli_federation("clean", run_id=RUN, rounds=1, sites=SITES), paho_client, hostile=False)
    fed = cli_federation("hostile", run_id=RUN, rounds=1, sites=SITES)
    hostile = _run(fed, paho_client, hostile=True)

    assert sorted(hostile) == sorted(clean)
    for name in clean:
        np.testing.assert_array_equal(hostile[name], clean[name], err_msg=name)
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["sites"] for r in report["rounds"]] == [list(SITES)]
    log = (fed.logs / "ps.log").read_text(errors="replace")
    assert "Traceback" not in log
    for reason in ("duplicate update", "stale or future round", "bfloat16", "the model has"):
        assert reason in log, f"PS log does not name {reason!r}"
    spool = fed.work / "ps" / "spool"
    left = sorted(p.name for p in spool.glob("round-*")) if spool.exists() else []
    assert all(int(name.split("-")[1]) <= 2 for name in left), f"spool holds far-away rounds: {left}"
