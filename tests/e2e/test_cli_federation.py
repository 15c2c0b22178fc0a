"""End to end through the CLI: Mosquitto, the PS and four heart-disease sites as separate processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np

from schemas import messages as m

ROUNDS = 3


def _round_closed(r: int):
    return lambda msg: isinstance(msg, m.RoundMetrics) and msg.phase == "train" and msg.round >= r


def test_killed_ps_resumes_to_the_same_weights(cli_federation) -> None:
    """A PS killed after round 1 and restarted with --resume ends with the uninterrupted run's weights."""
    # Prepare: run A, uninterrupted (PS first), with a plain mosquitto_sub as the observer.
    a = cli_federation("a", run_id="e2e-resume", rounds=ROUNDS)
    a.start_broker()
    creds = a.layout.settings("observer")
    sub = subprocess.Popen(
        ["mosquitto_sub", "-V", "5", "-h", creds.host, "-p", str(creds.port), "-u", creds.username,
         "-P", creds.password, "-v", "-t", "fedmqtt/#"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    a.start_ps()
    for site in a.site_configs:
        a.start_site(site)
    a.wait_ps_done(240)
    sub.send_signal(signal.SIGTERM)
    observed = sub.communicate(timeout=10)[0].splitlines()

    # Execute: run B, sites first; the PS is SIGKILLed right after round 1's checkpoint, then resumed. Its
    # processes start from fresh interpreters, as deployed ones do (the other tests fork theirs: harness.cli).
    b = cli_federation("b", run_id="e2e-resume", rounds=ROUNDS, fresh=True)
    b.start_broker()
    for site in b.site_configs:
        b.start_site(site)
    b.start_ps(fault="after_checkpoint:1")
    assert b.procs["ps"].wait(180) == -signal.SIGKILL, b.tail("ps")
    assert (b.work / "ps" / "checkpoints" / "round-000002.ckpt").is_file()
    b.start_ps(resume=True)
    b.wait_ps_done(240)

    # Assert: bit-identical final weights, and the resumed run did all rounds.
    wa, wb = a.final_weights(), b.final_weights()
    assert sorted(wa) == sorted(wb)
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)
    report_b = json.loads((b.work / "ps" / "report.json").read_text())
    assert [r["round"] for r in report_b["rounds"]] == list(range(1, ROUNDS + 1))
    assert "resuming from checkpoint of round 1" in b.tail("ps", 400)
    # The observer saw readable JSON status and metrics, and never a model or an update.
    topics_seen = {line.split(" ", 1)[0].split("/", 3)[-1] for line in observed if line.startswith("fedmqtt/")}
    assert {"ps/status", "ps/metrics"} <= topics_seen
    assert not any(t.startswith(("ps/model", "ps/task")) or t.endswith(("/update", "/report")) for t in topics_seen)
    metrics_lines = [line.split(" ", 1)[1] for line in observed if line.startswith("fedmqtt/v1/e2e-resume/ps/metrics ")]
    assert json.loads(metrics_lines[-1])["phase"] == "final"
    # Each round's metrics repeat what every accepted update cost and weighed (observers cannot read updates).
    for line in metrics_lines[:-1]:
        record = json.loads(line)
        assert sorted(record["usage"]) == sorted(record["update_bytes"]) == sorted(record["sites"]), record
        assert all(n > 1000 for n in record["update_bytes"].values())
        assert all(u["wall_s"] > 0 and u["device"] == "cpu" for u in record["usage"].values())


def test_report_and_watch_show_a_finished_run(cli_federation) -> None:
    """report.json has per-site and mean metrics per round and final; `topics watch` decodes every topic."""
    # Prepare
    fed = cli_federation("r", run_id="e2e-report", rounds=2)
    fed.start_broker()
    fed.start_ps()
    for site in fed.site_configs:
        fed.start_site(site)
    # Execute
    fed.wait_ps_done(240)
    watch = subprocess.run(
        [sys.executable, "-m", "fedmqtt", "topics", "watch", "--credentials", str(fed.layout.credentials["ps"]),
         "--run-id", "e2e-report", "--timeout", "3"], capture_output=True, text=True, timeout=60)
    # Assert
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert set(report["final"]["per_site"]) == {"cleveland", "hungary", "switzerland", "va"}
    for entry in report["final"]["per_site"].values():
        assert set(entry["metrics"]) == {"val", "test"}
        assert entry["n_samples"]["test"] > 0
    assert 0.5 < report["final"]["mean"]["test"]["auroc"] <= 1.0
    assert all(r["sites"] == ["cleveland", "hungary", "switzerland", "va"] for r in report["rounds"])
    assert report["traffic"]["bytes_received"] > 0 and report["traffic"]["bytes_sent"] > 0
    out = watch.stdout
    assert "ps/model" in out and "model mlp hash" in out
    # the sites' own reports are cleared at the broker once the PS is done (tests/e2e/test_retained_uplinks.py);
    # what they reported stays in the PS's retained final metrics
    final = [line for line in out.splitlines() if "final metrics" in line]
    assert final and set(final[-1].split(" over ")[1].split()[0].split(",")) == {"cleveland", "hungary", "switzerland",
                                                                                  "va"}
    # Each site removed its retained update once the PS had moved past its round: after the run the broker
    # holds no model-sized uplink per site (the stored copy stays in the site's state for a resumed PS)
    assert out.count("update:") == 0
    assert "INVALID" not in out
    assert max(len(line) for line in out.splitlines()) < 300  # summaries, never tensor dumps
    # Everything the PS and the sites wrote (checkpoints, spool, reports, models, uplinks, local state) is theirs
    # alone: 0600 files in 0700 folders
    written = [p for top in (fed.work / "ps", fed.work / "state") for p in [top, *top.rglob("*")]]
    assert len(written) > 10
    assert [(str(p), oct(p.stat().st_mode & 0o777)) for p in written if p.stat().st_mode & 0o077] == []


def test_run_survives_a_killed_site_and_a_broker_restart(cli_federation) -> None:
    """A site killed mid-run does not hang the round; a restarted broker is rejoined by every party."""
    # Prepare
    fed = cli_federation("k", run_id="e2e-faults", rounds=4)
    fed.start_broker()
    fed.start_ps()
    for site in fed.site_configs:
        fed.start_site(site)
    fed.wait_message(_round_closed(1), 180, "round 1 to close")
    # Execute: kill one hospital's agent, then bounce the broker (persistence keeps retained state).
    fed.kill("va")
    fed.wait_message(_round_closed(2), 180, "round 2 to close without va")
    fed.procs["broker"].send_signal(signal.SIGINT)
    fed.procs["broker"].wait(10)
    fed.observer.transport.close()
    fed.observer = None
    fed.start_broker()
    fed.wait_ps_done(240)
    # Assert
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["round"] for r in report["rounds"]] == [1, 2, 3, 4]
    assert all("va" not in r["sites"] for r in report["rounds"][2:])
    assert "missing" in report["final"]["per_site"]["va"]
    assert report["final"]["mean"]["test"]["auroc"] is not None
