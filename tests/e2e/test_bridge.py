"""Federations over TLS, as deployed: sites connecting directly (server-authenticated and mutual TLS), and
hospitals behind their own Mosquitto bridged to the federation's broker, one of them over a slow link; runs
end with the weights of the in-process simulation. Also: a hospital broker that crashes mid-run, the central broker
killed or restarted under bridged hospitals (the weights stay those of the simulation, which equal the single
broker's run: test_simulation_equivalence), the bridge's Will on the central broker, and a 64 MiB burst over a
4 MB/s bridge."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from harness import FAST_TRAIN, CliFederation, _port_open, mosquitto_pid, wait_until
from safetensors.numpy import load_file

from broker.bridge import BridgeFlow, load_hospital, write_hospital_broker
from broker.federation import init_federation
from broker.process import BrokerProcess
from fedmqtt.config_io import load_toml
from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from fedmqtt.transport import topics
from fedmqtt.transport.mqtt import MqttTransport
from fedmqtt.transport.settings import BrokerSettings
from schemas import messages as m

pytestmark = pytest.mark.slow

SITES = ("cleveland", "hungary", "switzerland")
ROUNDS = 3
TLS = ("--tls", "--host", "127.0.0.1", "--san", "localhost")
SMALL_CHUNKS = {"chunk_threshold_bytes": 1024, "chunk_bytes": 1024}  # every model and update travels chunked


def _simulated(tmp_path: Path, run_id: str) -> dict[str, np.ndarray]:
    sim = SimulationConfig(run_id=run_id, algorithm="fedavg", rounds=ROUNDS, seed=0, out_dir=tmp_path / "sim",
                           train=FAST_TRAIN, sites={s: d for s, d in bundled_sites().items() if s in SITES})
    run_simulation(sim, progress=False)
    return load_file(str(tmp_path / "sim" / "final_model.safetensors"))


def _assert_same(fed: CliFederation, expected: dict[str, np.ndarray]) -> None:
    got = fed.final_weights()
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
def test_tls_federation_matches_the_simulation(cli_federation, tmp_path: Path, mtls: bool) -> None:
    run_id = "tls-mtls" if mtls else "tls"
    fed = cli_federation(run_id, run_id=run_id, rounds=ROUNDS, sites=SITES,
                         init_extra=TLS + (("--mtls",) if mtls else ()))
    assert fed.layout.tls and fed.layout.mtls is mtls
    fed.run_to_completion(240)
    _assert_same(fed, _simulated(tmp_path, run_id))


class SlowLink:
    """A loopback TCP relay that passes at most `rate` bytes per second each way (bounded, stops on close)."""

    def __init__(self, target_port: int, rate: int) -> None:
        self.target_port, self.rate = target_port, rate
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()
        server.close()
        self.loop.run_until_complete(server.wait_closed())
        self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        step = max(1, self.rate // 20)  # 20 slices a second
        try:
            while data := await reader.read(step):
                writer.write(data)
                await writer.drain()
                await asyncio.sleep(len(data) / self.rate)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            self.loop.call_soon_threadsafe(task.cancel)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _bridge(fed: CliFederation, site: str, *, remote: str | None = None) -> Path:
    out = fed.work / f"hospital-{site}"
    args = ["broker", "bridge", "--credentials", str(fed.layout.credentials[site]), "--run-id", fed.layout.run_id,
            "--out", str(out), "--model-bytes", str(2**20), *(["--remote", remote] if remote else [])]
    subprocess.run([sys.executable, "-m", "fedmqtt", *args], check=True, capture_output=True)
    # the hospital's site agent now talks to its own broker
    cfg = fed.site_configs[site]
    text = cfg.read_text().replace(str(fed.layout.credentials[site]), str(out / "credentials" / f"{site}.toml"))
    cfg.write_text(text)
    return out


def _start_hospital(fed: CliFederation, site: str, out: Path) -> subprocess.Popen[bytes]:
    with open(fed.logs / f"hospital-{site}.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fedmqtt", "broker", "start", "--dir", str(out)],
                                stdout=log, stderr=subprocess.STDOUT)
    port = load_hospital(out).port
    wait_until(lambda: _port_open("127.0.0.1", port), 15, f"hospital broker of {site}")
    return proc


def _bridged_federation(cli_federation, run_id: str) -> tuple[CliFederation, SlowLink, dict[str, Path]]:
    """cleveland connects directly; hungary sits behind its own broker on a 64 KB/s link; switzerland behind
    its own broker on a plain loopback link."""
    fed = cli_federation(run_id, run_id=run_id, rounds=ROUNDS, sites=SITES, init_extra=TLS,
                         broker_extra=SMALL_CHUNKS)
    fed.start_broker()
    link = SlowLink(fed.layout.port, rate=64 * 1024)
    outs = {"hungary": _bridge(fed, "hungary", remote=f"127.0.0.1:{link.port}"),
            "switzerland": _bridge(fed, "switzerland")}
    return fed, link, outs


def _stop(hospitals: dict[str, subprocess.Popen[bytes]], link: SlowLink | None) -> None:
    for proc in hospitals.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(15)
    if link is not None:
        link.close()


def test_bridged_hospitals_match_the_simulation(cli_federation, tmp_path: Path) -> None:
    """Two hospitals behind bridged brokers (one on a slow link) end with the simulation's exact weights."""
    run_id = "bridged"
    fed, link, outs = _bridged_federation(cli_federation, run_id)
    hospitals: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for site, out in outs.items():
            hospitals[site] = _start_hospital(fed, site, out)
        fed.start_ps()
        for site in SITES:
            fed.start_site(site)
        fed.wait_ps_done(300)
        _assert_bridges_up(fed, run_id, list(outs))
    finally:
        _stop(hospitals, link)
    _assert_same(fed, _simulated(tmp_path, run_id))
    central_log = fed.layout.log_path.read_text(errors="replace")
    assert "u'hungary'" in central_log and "u'switzerland'" in central_log  # the bridges logged in as the sites


def test_hospital_broker_crash_mid_run(cli_federation) -> None:
    """switzerland's broker crashes (SIGKILL) after round 1 and is started again: the central broker fires the
    bridge's Will, the PS hears it, the run still completes, and the bridge is back up at the end. (The PS
    drops a site that goes offline from the open round, so the weights depend on when it comes back.)"""
    run_id = "crash"
    fed, link, outs = _bridged_federation(cli_federation, run_id)
    hospitals: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for site, out in outs.items():
            hospitals[site] = _start_hospital(fed, site, out)
        fed.start_ps()
        for site in SITES:
            fed.start_site(site)
        fed.wait_message(lambda msg: isinstance(msg, m.RoundMetrics) and msg.round >= 1, 180, "round 1 closed")
        _kill_tree(hospitals["switzerland"])  # no goodbye, no Will of the local site agent
        time.sleep(3)
        hospitals["switzerland"] = _start_hospital(fed, "switzerland", outs["switzerland"])
        fed.wait_ps_done(300)
        _assert_bridges_up(fed, run_id, list(outs))
    finally:
        _stop(hospitals, link)
    ps_log = (fed.logs / "ps.log").read_text(errors="replace")
    assert "site switzerland: its hospital broker or the link to it is down" in ps_log


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_central_broker_fault_under_bridged_hospitals_changes_nothing(cli_federation, tmp_path: Path,
                                                                       fault: signal.Signals) -> None:
    """The central broker dies mid-run under two bridged hospitals and one direct site, and comes back on its
    persistence file: SIGKILL (no Wills; the database of its last autosave) or SIGTERM (it fires every Will it
    holds, bridges' "0" and the direct site's "offline", and saves them). Every round still aggregates every
    site: the final weights are the simulation's, bit for bit, and the PS sees both bridges up again.

    Before: each reconnect attempt of a bridge queued its hospital broker's local "0" for the central broker,
    which after the link came back held "0" for an up hospital (SIGKILL: a round closed without it, its update
    refused as stale); after SIGTERM the PS took the replayed Wills for news and never took a bridge "1" for one."""
    run_id = "central"
    fed = cli_federation(run_id, run_id=run_id, rounds=ROUNDS, sites=SITES, init_extra=TLS, broker_extra=SMALL_CHUNKS,
                         round_timeout_s=120.0, ps_extra={"stall_s": 6.0})
    fed.start_broker()
    outs = {site: _bridge(fed, site) for site in ("hungary", "switzerland")}
    hospitals: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for site, out in outs.items():
            hospitals[site] = _start_hospital(fed, site, out)
        fed.start_ps()
        for site in SITES:
            fed.start_site(site)
        fed.wait_message(lambda msg: isinstance(msg, m.RoundMetrics) and msg.round >= 1, 180, "round 1 closed")
        os.kill(mosquitto_pid(fed.layout.conf_path), fault)
        assert fed.procs["broker"].wait(15) is not None
        if fed.observer is not None:
            fed.observer.transport.close()
            fed.observer = None
        time.sleep(3)  # each bridge tries to reconnect meanwhile (before: each try queued a "0")
        fed.start_broker()
        fed.wait_ps_done(300)
        _assert_bridges_up(fed, run_id, list(outs))
        # ...and the PS took them for up again: its last status (retained) counts every site online
        final = fed.retained_ps_status()
        assert isinstance(final, m.DaemonStatus)
        assert final.state == "done" and set(final.sites_online) == set(SITES), final
        assert final.dropped == {} and final.waiting_for == ()
    finally:
        _stop(hospitals, None)
    _assert_same(fed, _simulated(tmp_path, run_id))
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["sites"] for r in report["rounds"]] == [list(SITES)] * ROUNDS
    ps_log = (fed.logs / "ps.log").read_text(errors="replace")
    assert "went offline during round" not in ps_log and "Traceback" not in ps_log


def _assert_bridges_up(fed: CliFederation, run_id: str, sites: list[str]) -> None:
    """The PS has exited, so its user is free: read the bridges' retained state on the central broker."""
    ps = MqttTransport(fed.layout.settings("ps"), client_id="ps").connect(timeout_s=10)
    try:
        ps.subscribe([topics.site_bridge_topic(run_id, s) for s in sites])
        states = {}
        while len(states) < len(sites) and (msg := ps.get(5.0)) is not None:
            states[msg.topic] = msg.payload
        assert states == {topics.site_bridge_topic(run_id, s): b"1" for s in sites}
    finally:
        ps.close()


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL `fedmqtt broker start` and the mosquitto it runs (its own session, see broker/process.py)."""
    pid_file = None
    for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
        pid_file = int(child)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if pid_file is not None:
        os.kill(pid_file, signal.SIGKILL)
        while Path(f"/proc/{pid_file}").exists() and Path(f"/proc/{pid_file}/stat").read_text().split()[2] != "Z":
            time.sleep(0.05)


def test_bridge_state_reaches_the_central_broker(mosquitto_bin: str, tmp_path: Path) -> None:
    """The bridge says "1" on connect; when the hospital broker dies, the central broker fires its Will "0"."""
    central = init_federation(tmp_path / "fed", run_id="notify", site_ids=["site-a"], host="127.0.0.1",
                              names=["localhost"], tls=True, mtls=True)
    with BrokerProcess.start(central.conf_path, port=central.port, host=central.listen_host):
        hospital = write_hospital_broker(central.settings("site-a"), run_id="notify", site="site-a",
                                         out_dir=tmp_path / "hospital", model_bytes=2**20)
        ps = MqttTransport(central.settings("ps"), client_id="ps").connect(timeout_s=10)
        try:
            ps.subscribe([hospital.notification_topic])
            with BrokerProcess.start(hospital.conf_path, port=hospital.port) as local:
                up = ps.get(15.0)
                assert up is not None and up.payload == b"1"
                local.kill()
            # "1" may come twice (published on the central broker and, bridged out, from the local one)
            seen = []
            while (msg := ps.get(15.0)) is not None and msg.payload != b"0":
                seen.append(msg.payload)
            assert msg is not None and (msg.topic, msg.payload) == (hospital.notification_topic, b"0")
            assert set(seen) <= {b"1"}
        finally:
            ps.close()


def test_a_64_mib_burst_crosses_a_4_mb_s_bridge_both_ways(mosquitto_bin: str, tmp_path: Path) -> None:
    """64 retained QoS 2 messages of 1 MiB from the PS to a bridged site and back over a 4 MB/s link: none lost
    with the windows `broker bridge` derives (on both brokers). With the stock window of 20 on either side,
    Mosquitto 2.0.11 dropped 4-44 of them here."""
    count, size = 64, 2**20
    flow_window = BridgeFlow.for_model(count * size, 2**20).max_inflight_messages
    central = init_federation(tmp_path / "fed", run_id="burst", site_ids=["site-a"], host="127.0.0.1", tls=True,
                              max_inflight=flow_window)
    with BrokerProcess.start(central.conf_path, port=central.port, host=central.listen_host):
        link = SlowLink(central.port, rate=4 * 10**6)
        site_settings = central.settings("site-a").model_copy(update={"chunk_bytes": 2**20})
        hospital = write_hospital_broker(site_settings, run_id="burst", site="site-a", out_dir=tmp_path / "hospital",
                                         model_bytes=count * size, remote=f"127.0.0.1:{link.port}")
        assert hospital.flow.max_inflight_messages == flow_window
        try:
            with BrokerProcess.start(hospital.conf_path, port=hospital.port):
                ps = MqttTransport(central.settings("ps"), client_id="ps").connect(timeout_s=10)
                site = MqttTransport(load_toml(hospital.credentials, BrokerSettings, section="broker"),
                                     client_id="site-a").connect(timeout_s=10)
                try:
                    model, update = topics.ps_model_topic("burst"), topics.site_update_topic("burst", "site-a")
                    site.subscribe([topics.chunk_filter(model)])
                    ps.subscribe([topics.chunk_filter(update)])
                    wait_until(lambda: _bridge_up(central.log_path), 20, "bridge connected to the central broker")
                    time.sleep(1)  # its subscriptions follow the CONNACK
                    payload = bytes(range(256)) * (size // 256)
                    for sender, receiver, topic in ((ps, site, model), (site, ps, update)):
                        sender.publish_many([(topics.chunk_topic(topic, i), payload) for i in range(count)],
                                            timeout_s=120)
                        got: set[str] = set()
                        while len(got) < count and (msg := receiver.get(30.0)) is not None:
                            if msg.topic.startswith(topic + "/"):
                                assert msg.payload == payload
                                got.add(msg.topic)
                        assert len(got) == count, f"{topic}: {count - len(got)} of {count} messages lost"
                finally:
                    site.close()
                    ps.close()
        finally:
            link.close()


def _bridge_up(central_log: Path) -> bool:
    return central_log.is_file() and "New bridge connected" in central_log.read_text(errors="replace")
