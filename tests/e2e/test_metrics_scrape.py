"""The PS's Prometheus endpoint in a real federation (Mosquitto, the PS and two sites as CLI processes), scraped
over HTTP and parsed with prometheus_client's own parser."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.config import free_port
from fedmqtt.transport import topics
from ps_daemon.monitoring import KNOWN_REASONS, OTHER, PHASES
from schemas import messages as m

pytestmark = pytest.mark.e2e
RUN = "e2e-metrics"
SITES = ("cleveland", "hungary")
ROUNDS = 2
Samples = list[tuple[str, dict[str, str], float]]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def scrape_until(fed, port: int, check: Callable[[Samples], bool], what: str, timeout_s: float = 120) -> Samples:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        fed.check_alive()
        try:
            samples = scrape(port)
        except (urllib.error.URLError, ConnectionError):  # not listening yet
            samples = []
        if samples and check(samples):
            return samples
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; PS log:\n{fed.tail('ps')}")


def value(samples: Samples, name: str, **labels: str) -> float:
    found = [v for n, lab, v in samples if n == name and lab == labels]
    assert len(found) == 1, (name, labels, [s for s in samples if s[0] == name])
    return found[0]


def phase(samples: Samples) -> str:
    return next(lab["phase"] for n, lab, v in samples if n == "fedmqtt_ps_phase" and v == 1)


def refused(samples: Samples, site: str, reason: str) -> float:
    return sum(v for n, lab, v in samples if n == "fedmqtt_ps_refused_total" and lab == {"site": site,
                                                                                         "reason": reason})


def test_the_endpoint_follows_a_run_counts_refused_junk_and_keeps_its_labels_bounded(cli_federation) -> None:
    # Prepare: broker and PS (its endpoint on a free loopback port, lingering after the run), no site yet
    port = free_port()
    fed = cli_federation("m", run_id=RUN, rounds=ROUNDS, sites=SITES,
                         ps_extra={"metrics": {"port": port, "linger_s": 120}})
    fed.start_broker()
    fed.start_ps()
    waiting = scrape_until(fed, port, lambda s: value(s, "fedmqtt_ps_broker_connected") == 1, "the PS to connect")

    # Execute: junk from a real MQTT client with hungary's login, on hungary's own update topic
    creds = fed.layout.settings("hungary")
    subprocess.run(["mosquitto_pub", "-V", "5", "-h", creds.host, "-p", str(creds.port), "-u", creds.username,
                    "-P", creds.password, "-q", "1", "-t", topics.site_update_topic(RUN, "hungary"),
                    "-m", "not msgpack"], check=True, timeout=30)
    # unsigned, so refused before it is read
    junk = scrape_until(fed, port, lambda s: refused(s, "hungary", "unsigned") >= 1, "the junk to be refused")
    # ... then the sites: the run goes on, scraped while it trains and once it is done
    for site in SITES:
        fed.start_site(site)
    during = scrape_until(fed, port, lambda s: value(s, "fedmqtt_ps_rounds_closed_total") >= 1, "round 1 to close")
    fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and msg.state == "done", 240, "the run to finish")
    done = scrape_until(fed, port, lambda s: phase(s) == "done", "the endpoint to show the end")
    fed.procs["ps"].send_signal(signal.SIGTERM)  # ends the linger
    fed.wait_ps_done(30)

    # Check: before the sites came
    assert phase(waiting) == "waiting_for_sites" and value(waiting, "fedmqtt_ps_round") == 0
    assert value(waiting, "fedmqtt_ps_sites_configured") == 2 and value(waiting, "fedmqtt_ps_sites_online") == 0
    assert refused(junk, "hungary", "unsigned") == 1
    # while training, and at the end
    # (a fast run may already have finished by the time this scrape answers)
    assert phase(during) in ("training", "evaluating", "done") and value(during, "fedmqtt_ps_round") >= 2
    assert value(done, "fedmqtt_ps_rounds_closed_total") == ROUNDS
    assert value(done, "fedmqtt_ps_round") == ROUNDS + 1
    for site in SITES:
        assert value(done, "fedmqtt_ps_updates_accepted_total", site=site) == ROUNDS
        assert value(done, "fedmqtt_ps_site_online", site=site) == 1
    assert value(done, "fedmqtt_ps_round_duration_seconds_count") == ROUNDS
    assert value(done, "fedmqtt_ps_round_duration_seconds_bucket", le="+Inf") == ROUNDS
    assert value(done, "fedmqtt_ps_checkpoint_save_seconds_count") >= ROUNDS
    assert value(done, "fedmqtt_ps_bytes_sent_total") > 1000 and value(done, "fedmqtt_ps_bytes_received_total") > 1000
    assert refused(done, "hungary", "unsigned") == 1
    assert not [s for s in done if s[0] == "fedmqtt_ps_privacy_epsilon"]  # no privacy accountant: no number
    # every label value comes from a fixed set, whatever arrived
    allowed = {"site": {*SITES, OTHER}, "reason": KNOWN_REASONS | {OTHER}, "phase": set(PHASES)}
    for name, labels, _ in (*waiting, *junk, *during, *done):
        for label, allowed_values in allowed.items():
            assert labels.get(label, next(iter(allowed_values))) in allowed_values, (name, labels)
    assert len(done) < 200
    # the endpoint stopped with the PS
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_the_epsilon_gauge_says_what_ps_status_says_after_a_resume(cli_federation) -> None:
    """DP-FedAvg: the PS is SIGKILLed after round 1's checkpoint and resumed; the gauge of the resumed PS and its
    retained ps/status give the same participant-level epsilon, that of the run's last round."""
    pytest.importorskip("opacus")
    # Prepare
    port = free_port()
    fed = cli_federation("eps", run_id="e2e-metrics-eps", rounds=ROUNDS, sites=SITES, algorithm="dp-fedavg",
                         hyper={"clip_norm": 1.0, "noise_multiplier": 1.0},
                         ps_extra={"metrics": {"port": port, "linger_s": 120}})
    fed.start_broker()
    # Execute: killed after round 1's checkpoint, resumed, run to the end; the endpoint lingers
    fed.start_killed_and_resumed(SITES)
    done = scrape_until(fed, port, lambda s: phase(s) == "done", "the resumed PS to finish", timeout_s=240)
    status = fed.retained_ps_status()
    fed.procs["ps"].send_signal(signal.SIGTERM)  # ends the linger
    fed.wait_ps_done(30)
    # Assert
    assert "resuming from checkpoint of round 1" in fed.tail("ps", 400)
    assert isinstance(status, m.DaemonStatus) and status.state == "done" and status.participant_dp is not None
    assert value(done, "fedmqtt_ps_privacy_epsilon") == status.participant_dp.epsilon > 0
    assert status.participant_dp.rounds == ROUNDS
