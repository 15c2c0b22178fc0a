"""A hospital's own Mosquitto, bridged to the federation's broker for exactly one site's topics.

The hospital's site agent talks to its local broker on loopback; the bridge carries only that site's topics
across (out: everything the site writes; in: PS status, the global model and the site's own task, with their
chunks), logs in as the site with the site's central credentials over TLS, and announces its link state on a
per-site topic whose Will ("0") the central broker fires when the hospital broker or its link dies.

That topic (`site/<id>/bridge`) never crosses the bridge from the hospital's side: Mosquitto 2.0.11 also keeps a
local copy of the notification, and its Will "0" fires locally each time the link drops. With `site/<id>/#`
bridged out, every reconnect attempt queued that local "0" for the central broker (the bridge re-reads the local
retained messages of its out topics on each attempt), and after the link came back the queued copies arrived after
the bridge's own "1": the central broker then held "0" for a hospital that was up. So the out topics name the
site agent's kinds one by one, and the central broker hears only the bridge's "1" (sent on each connect) and its
Will "0" (fired by the central broker itself).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package (the `tomli` dependency)
    import tomli as tomllib

from broker import certs
from broker.acl import render_acl
from broker.config import Listener, free_port, render_broker_config
from broker.passwords import generate_password, write_password_file
from fedmqtt.config_io import dump_toml
from fedmqtt.errors import ConfigError
from fedmqtt.transport import topics
from fedmqtt.transport.settings import BrokerSettings, load_credentials
from fedmqtt.transport.signing import SIGNING_TABLE

# The central broker's default per-client limits (mosquitto.conf): a bridge is ONE client there, so everything
# the central holds for this site in flight or queued must fit these, or the central drops messages silently.
CENTRAL_MAX_INFLIGHT = 20
CENTRAL_MAX_QUEUED_BYTES = 268435456
BROKER_MAX_PACKET = 12648448
HOSPITAL_FILE = "hospital.toml"
_HEADROOM_MESSAGES = 200  # status, manifests, metrics, re-publishes


@dataclass(frozen=True)
class BridgeFlow:
    """Queue and in-flight limits of a hospital broker, derived from the largest model it will carry."""

    max_inflight_messages: int
    max_queued_messages: int
    max_queued_bytes: int

    @classmethod
    def for_model(cls, model_bytes: int, chunk_bytes: int) -> BridgeFlow:
        # Inbound per round: the global model and this site's task (each up to model_bytes, chunked); outbound:
        # one update. Twice that, so a re-published round queued behind a slow link still fits.
        chunks = math.ceil(model_bytes / chunk_bytes)
        messages = 2 * (3 * (chunks + 1)) + _HEADROOM_MESSAGES
        queued_bytes = max(CENTRAL_MAX_QUEUED_BYTES, 2 * 3 * model_bytes + 64 * 1024 * 1024)
        # Over a slow link the PUBRELs of a QoS 2 burst queue behind the payloads, and Mosquitto 2.0.11 lets the
        # sender run ahead of the receiver's in-flight quota; past it the receiver drops the message (PUBREC
        # 0x97 under MQTT v5, silently under 3.1.1). Measured at 4 MB/s with 64 x 1 MiB: 20 lost 24 chunks, 40
        # lost 4, a window above the burst lost none. So the window covers a whole burst, on BOTH brokers
        # (`broker init --max-inflight` for the central one).
        return cls(max_inflight_messages=max(messages, 2 * CENTRAL_MAX_INFLIGHT),
                   max_queued_messages=max(1000, messages), max_queued_bytes=queued_bytes)


@dataclass(frozen=True)
class HospitalBroker:
    """What `write_hospital_broker` produced."""

    out_dir: Path
    conf_path: Path
    port: int
    credentials: Path  # the site agent's: local broker, plain loopback
    notification_topic: str
    flow: BridgeFlow


def bridge_client_id(run_id: str, site: str) -> str:
    """The bridge's client id on the central broker: one per hospital, so two bridges never take each other's
    session (MQTT disconnects the older client of a duplicate id)."""
    return f"fedmqtt-bridge-{run_id}-{site}"


def write_hospital_broker(
    central: BrokerSettings,
    *,
    run_id: str,
    site: str,
    out_dir: Path,
    model_bytes: int,
    local_port: int | None = None,
    remote: str | None = None,
    force: bool = False,
    signing: dict[str, object] | None = None,
) -> HospitalBroker:
    """Lay out a hospital broker under `out_dir` from the site's central credentials (`central`).

    `model_bytes`: the largest model (or task) the run exchanges; it sizes the queues. `remote`: host:port the
    bridge dials instead of the central address (an outbound proxy); TLS still checks the central's name only
    when it is the same. `signing`: the site's `[signing]` table, copied into the local credentials (the agent
    signs with it). Files holding secrets
    (the config with the central password, keys, passwords, local credentials) are written 0600.
    """
    topics.validate_id(run_id, what="run id")
    topics.validate_id(site, what="site id")
    if central.username != site:
        raise ConfigError(f"these credentials are for {central.username!r}, not for site {site!r}")
    if not central.tls:
        raise ConfigError("the central credentials have no TLS CA: a bridge crosses the hospital's network "
                          "boundary and must use TLS")
    if model_bytes <= 0:
        raise ConfigError("--model-bytes must be positive")
    out_dir = Path(out_dir).resolve()
    if (out_dir / "mosquitto.conf").exists() and not force:
        raise ConfigError(f"{out_dir} already holds a hospital broker; pass force to replace it")
    for sub in ("data", "credentials", "tls"):
        (out_dir / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
    port = local_port if local_port is not None else free_port("127.0.0.1")
    flow = BridgeFlow.for_model(model_bytes, central.chunk_bytes)

    tls = out_dir / "tls"
    ca_file = _pem_file(tls / "ca.crt", central.tls_ca_pem, central.tls_ca_file, private=False)
    if ca_file is None:  # cannot happen: central.tls (checked above) means a CA file or PEM is configured
        raise ConfigError("the central credentials have no TLS CA")
    cert_file = _pem_file(tls / "client.crt", central.tls_cert_pem, central.tls_cert_file, private=False)
    key_file = _pem_file(tls / "client.key", central.tls_key_pem, central.tls_key_file, private=True)

    local_password = generate_password()
    passwd = out_dir / "passwd"
    write_password_file(passwd, {site: local_password})
    acl = out_dir / "acl"
    # The same rights on the hospital broker as on the central one (only the site's block matters here).
    acl.write_text(render_acl(run_id, [site]), encoding="utf-8")

    notification = topics.site_bridge_topic(run_id, site)
    conf = render_broker_config(
        listeners=[Listener(port, "127.0.0.1")],  # the hospital's own network never sees this broker
        password_file=passwd,
        acl_file=acl,
        persistence_dir=out_dir / "data",
        log_file=out_dir / "mosquitto.log",
        extra=_flow_lines(flow)
        + _bridge_lines(central, run_id, site, ca_file, cert_file, key_file, notification,
                        remote or f"{central.host}:{central.port}"),
    )
    conf_path = out_dir / "mosquitto.conf"
    certs.write_private(conf_path, conf.encode("utf-8"))  # holds the site's central password

    local = {**central.model_dump(exclude_none=True, mode="json"), "host": "127.0.0.1", "port": port,
             "username": site, "password": local_password}
    for field in ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_ca_pem", "tls_cert_pem", "tls_key_pem",
                  "tls_seat_certs_pem", "tls_broker_key_sha256"):
        local.pop(field, None)  # loopback to its own broker: no TLS
    BrokerSettings.model_validate(local)
    cred = out_dir / "credentials" / f"{site}.toml"
    # The site's signing key and key list go with it: its messages are signed end to end, across the bridge.
    data: dict[str, object] = {SIGNING_TABLE: signing, "broker": local} if signing is not None else {"broker": local}
    certs.write_private(cred, dump_toml(data).encode("utf-8"))
    meta = {"run_id": run_id, "site": site, "port": port, "central": f"{central.host}:{central.port}"}
    (out_dir / HOSPITAL_FILE).write_text(dump_toml(meta), encoding="utf-8")
    return HospitalBroker(out_dir, conf_path, port, cred, notification, flow)


def load_hospital(out_dir: Path) -> HospitalBroker:
    """The hospital broker that `write_hospital_broker` laid out in `out_dir`."""
    out_dir = Path(out_dir).resolve()
    meta = tomllib.loads((out_dir / HOSPITAL_FILE).read_text(encoding="utf-8"))
    run_id, site = topics.validate_id(meta["run_id"]), topics.validate_id(meta["site"])
    conf = (out_dir / "mosquitto.conf").read_text(encoding="utf-8")
    flow = BridgeFlow(*(int(_directive(conf, k)) for k in ("max_inflight_messages", "max_queued_messages",
                                                            "max_queued_bytes")))
    return HospitalBroker(out_dir, out_dir / "mosquitto.conf", int(meta["port"]),
                          out_dir / "credentials" / f"{site}.toml", topics.site_bridge_topic(run_id, site), flow)


def _directive(conf: str, name: str) -> str:
    values = [ln.split()[1] for ln in conf.splitlines() if ln.startswith(name + " ")]
    if not values:
        raise ConfigError(f"no {name} in the hospital broker config")
    return values[-1]  # the last one wins, as in Mosquitto


def load_central(credentials: Path) -> BrokerSettings:
    return load_credentials(credentials)


def _flow_lines(flow: BridgeFlow) -> list[str]:
    # Later lines win in Mosquitto, so these override the base file's defaults for this broker only.
    return [
        "# sized for the largest model this hospital exchanges (broker bridge --model-bytes)",
        f"max_inflight_messages {flow.max_inflight_messages}",
        f"max_queued_messages {flow.max_queued_messages}",
        f"max_queued_bytes {flow.max_queued_bytes}",
    ]


def _bridge_lines(
    central: BrokerSettings, run_id: str, site: str, ca: Path, cert: Path | None, key: Path | None, note: str,
    address: str,
) -> list[str]:
    lines = [
        f"connection fedmqtt-{run_id}-{site}",
        f"address {address}",
        f"remote_clientid {bridge_client_id(run_id, site)}",
        f"local_clientid fedmqtt-bridge-local-{run_id}-{site}",
        f"remote_username {site}",
        f"remote_password {central.password}",
        # MQTT 3.1.1 with try_private: the central broker recognises a bridge and keeps the retain flag of
        # forwarded messages, which is how models, tasks and chunks reach late joiners here.
        "bridge_protocol_version mqttv311",
        "try_private true",
        # A persistent session on the central broker: QoS 2 messages published while the link is down are
        # queued there (within the central's limits) and delivered when the bridge comes back.
        "cleansession false",
        "restart_timeout 2 30",
        "keepalive_interval 30",
        f"bridge_max_packet_size {BROKER_MAX_PACKET}",
        "bridge_outgoing_retain true",
        "notifications true",
        "notifications_local_only false",
        f"notification_topic {note}",
        f"bridge_cafile {ca}",
        "bridge_insecure false",
        "bridge_tls_version tlsv1.2",
    ]
    if cert is not None and key is not None:
        lines += [f"bridge_certfile {cert}", f"bridge_keyfile {key}"]
    ps_model = topics.ps_model_topic(run_id)
    ps_task = topics.ps_task_topic(run_id, site)
    lines += [f"topic {topic} out 2" for topic in site_out_topics(run_id, site)]
    lines += [
        f"topic {topics.ps_status_topic(run_id)} in 2",
        f"topic {ps_model} in 2",
        f"topic {topics.chunk_filter(ps_model)} in 2",
        f"topic {ps_task} in 2",
        f"topic {topics.chunk_filter(ps_task)} in 2",
        f"topic {topics.ps_turn_topic(run_id, site)} in 2",
        f"topic {topics.federation_keys_topic(run_id)} in 2",  # key list changes reach the hospital's agent
    ]
    return lines


def site_out_topics(run_id: str, site: str) -> list[str]:
    """What the bridge carries to the central broker: every kind the site agent writes, with its chunks; not the
    bridge's notification topic (see the module's docstring)."""
    out: list[str] = []
    for kind in topics.SITE_KINDS:
        topic = topics.site_topic(run_id, site, kind)
        out.append(topic)
        if ("site", kind) in topics.CHUNKED_KINDS:
            out.append(topics.chunk_filter(topic))
    return out


def _pem_file(path: Path, pem: str | None, source: Path | None, *, private: bool) -> Path | None:
    """Mosquitto reads certificates from files: write the inline PEM (or a copy of the file) next to the config."""
    data = pem.encode("ascii") if pem is not None else Path(source).read_bytes() if source is not None else None
    if data is None:
        return None
    certs.write_private(path, data)
    if not private:
        path.chmod(0o644)
    return path
