"""Upload turns, as deployed: with every update chunked, the broker never holds more sites' updates than the PS
grants turns, the PS removes each one it has accepted, and a PS killed right after removing one resumes (the site
sends it again in a new turn) to the weights of the in-process simulation."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
from harness import FAST_TRAIN
from safetensors.numpy import load_file

from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from fedmqtt.transport import topics

pytestmark = pytest.mark.slow

SITES = ("cleveland", "hungary", "switzerland")
ROUNDS = 2
SMALL_CHUNKS = {"chunk_threshold_bytes": 1024, "chunk_bytes": 1024}  # every model and update travels chunked
READER = "observer.7"  # given read access to the updates for this test only


def _simulated(tmp_path: Path, run_id: str) -> dict[str, np.ndarray]:
    sim = SimulationConfig(run_id=run_id, algorithm="fedavg", rounds=ROUNDS, seed=0, out_dir=tmp_path / "sim",
                           train=FAST_TRAIN, sites={s: d for s, d in bundled_sites().items() if s in SITES})
    run_simulation(sim, progress=False)
    return load_file(str(tmp_path / "sim" / "final_model.safetensors"))


def _grant_reader_the_updates(fed, run_id: str) -> None:
    """Let one observer seat read every site's update and chunks (the generated ACL lets no observer do that)."""
    acl = fed.layout.broker_dir / "acl"
    text = acl.read_text(encoding="utf-8")
    block = f"user {READER}\n"
    assert block in text
    extra = f"topic read {topics.run_prefix(run_id)}/site/+/update/#\n"
    acl.write_text(text.replace(block, block + extra), encoding="utf-8")


def _most_sites_held(events: list[tuple[str, bool]]) -> tuple[int, int, dict[str, bool]]:
    """Replay what the broker held: (the most sites with retained update chunks at one time, how many uploads
    began, what is held at the end). Mosquitto forwards to one subscriber in the order it stored the messages."""
    held: dict[str, bool] = {}
    most = uploads = 0
    for topic, nonempty in events:
        if "/chunk/" not in topic:
            continue
        if nonempty and topic.endswith("/chunk/0"):
            uploads += 1
        held[topic] = nonempty
        most = max(most, len({t.split("/site/")[1].split("/")[0] for t, on in held.items() if on}))
    return most, uploads, {t: on for t, on in held.items() if on}


def test_one_upload_turn_bounds_the_broker_and_survives_a_ps_kill(cli_federation, paho_client,
                                                                    tmp_path: Path) -> None:
    # Prepare: one turn, every update chunked, and a reader that records each update chunk the broker stores
    run_id = "e2e-turns"
    expected = _simulated(tmp_path, run_id)
    fed = cli_federation("turns", run_id=run_id, rounds=ROUNDS, sites=SITES, ps_extra={"upload_turns": 1},
                         broker_extra=SMALL_CHUNKS)
    _grant_reader_the_updates(fed, run_id)
    fed.start_broker()
    reader = paho_client(fed.layout.settings("observer").model_copy(update={"username": READER}))
    events: list[tuple[str, bool]] = []
    reader.on_message = lambda _c, _u, msg: events.append((msg.topic, bool(msg.payload)))
    reader.subscribe(f"{topics.run_prefix(run_id)}/site/+/update/#", qos=2)

    # Execute: the PS dies right after it removed the first accepted update of round 2, then resumes
    for site in SITES:
        fed.start_site(site)
    fed.start_ps(fault="after_update_cleared:2")
    assert fed.procs["ps"].wait(180) == -signal.SIGKILL, fed.tail("ps")
    fed.start_ps(resume=True)
    fed.wait_ps_done(240)

    # Assert: the simulation's weights; never two sites' updates at the broker; every upload removed at the end
    got = fed.final_weights()
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    most, uploads, left = _most_sites_held(list(events))
    assert most == 1, events[:50]
    assert uploads >= len(SITES) * ROUNDS + 1, uploads  # the update the killed PS had removed went up twice
    assert not left
    sites_log = "".join(fed.tail(site, 400) for site in SITES)
    assert "waiting for an upload turn" in sites_log and "upload turn" in sites_log
    assert "resuming from checkpoint of round 1" in fed.tail("ps", 400)


def test_a_site_killed_in_its_turn_gets_a_new_one_after_its_restart(cli_federation, tmp_path: Path) -> None:
    # Prepare: one turn, every update chunked; one site dies in its round-2 turn, before its chunks go up. A quorum
    # of all sites keeps round 2 open for it (else the PS closes the round without a site that went offline).
    run_id = "e2e-turn-site"
    expected = _simulated(tmp_path, run_id)
    fed = cli_federation("turn-site", run_id=run_id, rounds=ROUNDS, sites=SITES,
                         ps_extra={"upload_turns": 1, "quorum": len(SITES)}, broker_extra=SMALL_CHUNKS)
    killed = SITES[1]
    fed.start_broker()
    fed.start_ps()
    for site in SITES:
        fed.start_site(site, fault="site_before_publish:2" if site == killed else None)

    # Execute: the PS sees it offline (its Will) and frees the turn; the restarted site announces its stored update
    assert fed.procs[killed].wait(180) == -signal.SIGKILL, fed.tail(killed)
    fed.start_site(killed)
    fed.wait_ps_done(240)

    # Assert: the simulation's weights; the site used a turn before its death and a new one after its restart
    got = fed.final_weights()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    log = fed.tail(killed, 400)
    assert "round 2: re-publishing the stored update" in log
    assert log.count("round 2: upload turn") == 2, log
