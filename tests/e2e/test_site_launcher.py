"""`fedmqtt site start` with several --config (site_agent/launcher.py): one interpreter imports once and forks a
site process per config. Real Mosquitto, a real PS, and the launcher as a fresh interpreter, as a user starts it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from harness import CliFederation, cli, wait_until

SITES = ("cleveland", "hungary")


def launch(fed: CliFederation, *, env: dict[str, str] | None = None, exit_when_done: bool = True) -> None:
    configs = [arg for site in fed.sites for arg in ("--config", str(fed.site_configs[site]))]
    fed.procs["sites"] = cli("site", "start", *configs, *(["--exit-when-done"] if exit_when_done else []),
                             log=fed.logs / "sites.log", env=env, fresh=True)


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def running(pid: int) -> bool:
    """Alive and not a zombie (a child whose parent was killed may wait for a reaper that never comes)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_one_launcher_runs_two_sites_through_the_run(cli_federation) -> None:
    # Setup
    fed = cli_federation("launcher", run_id="launcher", rounds=2, sites=SITES)
    fed.start_broker()
    fed.start_ps()
    # Execute
    launch(fed)
    fed.wait_ps_done(300)
    rc = fed.procs["sites"].wait(60)
    # Assert: both sites took part, each in its own process, and the launcher said how each ended
    log = fed.tail("sites", 1000)
    assert rc == 0, log
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert sorted(report["final"]["per_site"]) == sorted(SITES)
    pids = set()
    for site in SITES:
        assert f"[{site}] fedmqtt.site: site {site} online" in log
        started = next(line for line in log.splitlines() if f"site {site} started as process" in line)
        pid = int(started.rsplit(" ", 1)[1])
        assert f"site {site} (process {pid}) exited" in log
        pids.add(pid)
    assert len(pids) == 2 and fed.procs["sites"].pid not in pids


def test_killing_the_launcher_stops_its_sites(cli_federation) -> None:
    # Setup: both sites online, waiting for their first task
    fed = cli_federation("launcher-killed", run_id="launcher", rounds=50, sites=SITES)
    fed.start_broker()
    fed.start_ps()
    launch(fed, exit_when_done=False)
    parent = fed.procs["sites"].pid
    wait_until(lambda: all(f"site {s} online" in fed.tail("sites", 1000) for s in SITES), 120, "both sites online")
    sites = children(parent)
    assert len(sites) == 2
    # Execute
    fed.kill("sites")
    # Assert: the kernel's SIGTERM (PR_SET_PDEATHSIG) stopped each site as `site start` stops
    wait_until(lambda: not any(running(pid) for pid in sites), 30, "the sites stopped")
    assert fed.tail("sites", 1000).count("MQTT traffic") == 2  # each agent closed its connection itself


def test_a_site_that_dies_is_reported_with_its_cause(cli_federation) -> None:
    # Setup: every site SIGKILLs itself before publishing its round-1 update (fault injection, fedmqtt/faults.py)
    fed = cli_federation("launcher-fault", run_id="launcher", rounds=2, sites=SITES)
    fed.start_broker()
    fed.start_ps()
    # Execute
    launch(fed, env={**os.environ, "FEDMQTT_FAULT": "site_before_publish:1"})
    rc = fed.procs["sites"].wait(300)
    # Assert
    log = fed.tail("sites", 1000)
    assert rc == 128 + signal.SIGKILL, log
    for site in SITES:
        assert f"site {site} (process " in log and "killed by SIGKILL" in log


def test_sigterm_to_the_launcher_stops_every_site_and_it_exits_0(cli_federation) -> None:
    # Setup: both sites online, waiting for their first task
    fed = cli_federation("launcher-sigterm", run_id="launcher", rounds=50, sites=SITES)
    fed.start_broker()
    fed.start_ps()
    launch(fed, exit_when_done=False)
    wait_until(lambda: all(f"site {s} online" in fed.tail("sites", 1000) for s in SITES), 120, "both sites online")
    # Execute
    fed.procs["sites"].send_signal(signal.SIGTERM)
    rc = fed.procs["sites"].wait(60)
    # Assert: relayed to each site, which stopped as `site start` stops (closing its connection), exit 0
    log = fed.tail("sites", 1000)
    assert rc == 0, log
    assert log.count("MQTT traffic") == 2
    for site in SITES:
        assert f"site {site} (process " in log
    assert "ERROR" not in log


def test_two_configs_of_one_site_are_refused_before_anything_starts(cli_federation) -> None:
    # Setup
    fed = cli_federation("launcher-twice", run_id="launcher", rounds=1, sites=SITES)
    config = str(fed.site_configs[SITES[0]])
    # Execute
    proc = cli("site", "start", "--config", config, "--config", config, log=fed.logs / "twice.log", fresh=True)
    rc = proc.wait(120)
    # Assert: one clear line, exit 2, no site started
    log = (fed.logs / "twice.log").read_text()
    assert rc == 2, log
    assert f"each --config needs its own site id; given twice: {SITES[0]}" in log
    assert "started as process" not in log
