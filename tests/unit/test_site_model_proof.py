"""A site trains only on a model whose bytes are proven: a model that travels whole must hash to its `model_hash`;
a chunked one is proven by its chunks' SHA-256s in the manifest the PS signed, and is not hashed a second time
(issue 30: one hash pass over the model, not two)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedmqtt.simulation import SimulationConfig
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.memory import SIMULATION_SETTINGS, MemoryBroker, MemoryTransport
from fedmqtt.transport.signing import FederationKeys
from schemas import messages as m
from schemas.tensors import arrays_to_blobs, tensors_hash
from site_agent.agent import SiteAgent


def _federation(tmp_path: Path) -> tuple[SiteAgent, FederationKeys, MemoryBroker]:
    config = SimulationConfig(out_dir=tmp_path / "out", rounds=1)
    site = config.site_configs()[0]
    keys = FederationKeys(config.run_id, ["ps", site.site_id])
    broker = MemoryBroker()

    def factory(**kw: Any) -> MemoryTransport:
        return MemoryTransport(broker, **kw)

    agent = SiteAgent(site, transport_factory=factory, identity=keys.identity(site.site_id))
    agent.start()
    return agent, keys, broker


def _model(run_id: str, round_no: int, model_hash: str | None = None) -> m.GlobalModel:
    blobs = arrays_to_blobs({"w": np.random.default_rng(round_no).normal(size=4096).astype(np.float32)})
    return m.GlobalModel(run_id=run_id, sender="ps", round=round_no, session="5e55", model=m.ModelSpec(name="mlp"),
                         model_hash=model_hash or tensors_hash(blobs), tensors=blobs)


def _send_as_ps(broker: MemoryBroker, keys: FederationKeys, model: m.GlobalModel, *, chunked: bool) -> None:
    settings = SIMULATION_SETTINGS.model_copy(update={"chunk_threshold_bytes": 1024, "chunk_bytes": 4096}
                                              if chunked else {})
    ps = Channel(MemoryTransport(broker, settings, client_id=f"ps-{chunked}"), run_id=model.run_id,
                 identity=keys.identity("ps"))
    ps.connect()
    ps.send(topics.ps_model_topic(model.run_id), model)


def _received(agent: SiteAgent) -> set[int]:
    for _ in range(200):
        agent.receive(0)
    return {model.round for model in agent.models.values()}


def test_a_whole_model_that_does_not_hash_to_its_label_is_refused(tmp_path: Path) -> None:
    # Prepare
    agent, keys, broker = _federation(tmp_path)
    run = agent.config.run_id
    # Execute: a good model, then one whose label is not its tensors' hash (signed by the PS all the same)
    _send_as_ps(broker, keys, _model(run, 1), chunked=False)
    _send_as_ps(broker, keys, _model(run, 2, model_hash="0" * 64), chunked=False)
    # Assert
    assert _received(agent) == {1}
    assert agent.channel.fetcher.stats.chunks == 0  # both travelled whole
    agent.close()


def test_a_chunked_model_is_proven_by_its_signed_chunk_digests(tmp_path: Path) -> None:
    # Prepare
    agent, keys, broker = _federation(tmp_path)
    run = agent.config.run_id
    good = _model(run, 1)
    # Execute
    _send_as_ps(broker, keys, good, chunked=True)
    # Assert: it arrived in chunks, every chunk checked, and is kept under its label
    assert _received(agent) == {1}
    assert agent.channel.fetcher.stats.completed == 1 and agent.channel.fetcher.stats.corrupt == 0
    assert agent.models[("5e55", good.model_hash)].tensors == good.tensors
    agent.close()


def test_a_chunk_altered_at_the_broker_never_reaches_the_agent(tmp_path: Path) -> None:
    """What the skipped second hash would have caught is caught by the chunk digests: a broker operator who flips
    one byte of a retained chunk gets it refused and fetched again, and the transfer fails rather than deliver it."""
    # Prepare
    agent, keys, broker = _federation(tmp_path)
    run = agent.config.run_id
    _send_as_ps(broker, keys, _model(run, 1), chunked=True)  # the agent holds the manifest, no chunk yet
    chunk_topic = topics.ps_model_topic(run) + "/chunk/1"
    stored = broker.retained[chunk_topic]
    broker.retained[chunk_topic] = stored[:-1] + bytes([stored[-1] ^ 1])  # the last byte is tensor data
    # Execute
    received = _received(agent)
    # Assert
    assert received == set()
    assert agent.channel.fetcher.stats.corrupt >= 1 and agent.channel.fetcher.stats.completed == 0
    agent.close()
