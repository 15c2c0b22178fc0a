"""Log in as the site would, look at the run, leave without a trace.

The check logs in as `<site>.check` (broker/acl.py): the same password (and, under mutual TLS, a certificate of
the same key) but its own login, so it never takes over the connection of an agent already running (the broker
allows one connection per login), and read-only, so whatever it does it cannot publish into the federation. It
sets no Last Will, subscribes only to `ps/status` and `ps/model` (retained replays: their reading changes nothing),
and disconnects cleanly. The CONNACK and SUBACK codes are explained by fedmqtt.transport.reasons, as for the agent.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from broker.acl import CHECK_SEAT, check_login
from fedmqtt.errors import BrokerError, PermanentBrokerError
from fedmqtt.transport import topics
from fedmqtt.transport.mqtt import MqttTransport, RawMessage
from fedmqtt.transport.reasons import advice, code_name, is_transient
from fedmqtt.transport.settings import BrokerSettings
from schemas import messages as m
from schemas.chunks import ChunkManifest
from schemas.codec import decode
from site_agent.preflight.clock import AGREE_S, StatusSample
from site_agent.preflight.findings import Finding, failed, passed, warned

LOGIN, RUN = "login", "run"
SETTLE_S = 0.5  # retained replays follow the SUBACK at once; quiet this long means all have arrived


@dataclass
class Visit:
    """What the check saw while logged in."""

    statuses: list[tuple[m.DaemonStatus, StatusSample]] = field(default_factory=list)
    status_refused: str = ""  # the broker refused the subscription to ps/status: cause
    unreadable: str = ""  # a ps/status that did not decode: why
    model_bytes: int | None = None

    def samples(self) -> list[StatusSample]:
        return [sample for _, sample in self.statuses]


def visit(settings: BrokerSettings, run_id: str, *, timeout_s: float, live_wait_s: float
          ) -> tuple[Visit | None, Finding]:
    """Log in, read ps/status and ps/model, disconnect: the login's finding, and what was read."""
    login = check_login(settings.username)
    broker = f"{settings.host}:{settings.port}"
    if settings.tls_cert_pem is not None and settings.seat_cert(CHECK_SEAT) is None:
        return None, warned(LOGIN, f"not tried: the credentials carry no client certificate for {login}, and "
                            f"logging in as {settings.username} would push a running agent off",
                            f"The broker's operator runs `fedmqtt broker rotate --dir FED --party {settings.username}` "
                            "and sends you the new credentials file.", login=login)
    transport = MqttTransport(settings, client_id=login, seat=CHECK_SEAT)
    start = time.perf_counter()
    try:
        transport.connect(timeout_s=timeout_s)
    except BrokerError as exc:  # a refusal, permanent or (retried until the timeout) transient; or silence
        if isinstance(exc, PermanentBrokerError) or transport.refusals:
            return None, _refused(transport, exc, login=login, broker=broker)
        return None, failed(LOGIN, str(exc), "The broker took the connection but gave no CONNACK: see its log "
                            "(mosquitto.log in the federation's broker folder) or ask its operator.", login=login)
    ms = (time.perf_counter() - start) * 1000
    seen = Visit()
    try:
        _read(transport, seen, run_id, live_wait_s=live_wait_s)
    finally:
        transport.close()  # DISCONNECT 0x00: no Will to fire, nothing published
    return seen, passed(LOGIN, f"CONNACK success (0x00) as {login} in {ms:.0f} ms; read-only login, nothing "
                        "published, disconnected cleanly", login=login, connack=0, connect_ms=round(ms, 1))


def _refused(transport: MqttTransport, exc: BrokerError, *, login: str, broker: str) -> Finding:
    codes = sorted(transport.refusals)
    if not codes:  # closed without a CONNACK: a plain client at a TLS listener (tls_diagnosis says so)
        cause, _, question = str(exc).partition(": is it ")
        fix = f"Is it {question}" if question else "See the broker's log or ask its operator."
        return failed(LOGIN, cause, fix, login=login)
    code = codes[-1]
    fix = advice(f"connection as {login!r}", code, user=login, broker=broker)
    if is_transient(code):
        fix = "A passing state of the broker (the agent retries by itself): run the check again in a minute."
    elif code in (0x86, 0x87):
        fix += (f" A federation set up before `fedmqtt site check` existed has no login {login!r} yet: its "
                f"operator runs `fedmqtt broker rotate --dir FED --party {login.rsplit('.', 1)[0]}` and sends you "
                "the new credentials file.")
    return failed(LOGIN, f"CONNACK {code_name(code).lower()} (0x{code:02X}) for {login}", fix, login=login,
                  connack=code)


def _read(transport: MqttTransport, seen: Visit, run_id: str, *, live_wait_s: float) -> None:
    status_topic, model_topic = topics.ps_status_topic(run_id), topics.ps_model_topic(run_id)
    try:
        transport.subscribe([status_topic])
    except PermanentBrokerError as exc:
        seen.status_refused = str(exc)
        return
    try:
        transport.subscribe([model_topic])
    except PermanentBrokerError:
        pass  # the model's size stays unknown; what arrived before is still in the inbox
    _settle(transport, seen, status_topic)
    if not _fresh(seen):  # wait a little for a status sent now (a PS in a round sends one per second or so)
        _await_live(transport, seen, status_topic, live_wait_s)


def _settle(transport: MqttTransport, seen: Visit, status_topic: str) -> None:
    """Take the retained replays: they follow the SUBACK at once, so SETTLE_S of quiet means all are in."""
    while True:
        try:
            _take(transport.inbox.get(timeout=SETTLE_S), seen, status_topic)
        except queue.Empty:
            return


def _await_live(transport: MqttTransport, seen: Visit, status_topic: str, wait_s: float) -> None:
    end = time.monotonic() + wait_s
    while not any(s.live for s in seen.samples()) and transport.connected:
        left = end - time.monotonic()
        if left <= 0:
            return
        try:
            _take(transport.inbox.get(timeout=left), seen, status_topic)
        except queue.Empty:
            return


def _take(message: RawMessage, seen: Visit, status_topic: str) -> None:
    received_at = time.time()
    if not message.payload:
        return  # a cleared retained topic
    if message.topic != status_topic:  # ps/model: its size, whole or as declared by its chunk manifest
        try:
            model = decode(message.payload)
        except Exception:  # noqa: BLE001 - a model this build cannot read still has a size
            model = None
        seen.model_bytes = model.total_bytes if isinstance(model, ChunkManifest) else len(message.payload)
        return
    try:
        status = decode(message.payload)
    except Exception as exc:  # noqa: BLE001 - reported, never raised: the check goes on
        seen.unreadable = str(exc)
        return
    if isinstance(status, m.DaemonStatus):
        seen.statuses.append((status, StatusSample(status.sent_at, received_at, live=not message.retain)))


def _fresh(seen: Visit) -> bool:
    return any(s.live or abs(s.received_at - s.sent_at) <= AGREE_S for s in seen.samples())


def check_run(seen: Visit, site_id: str, run_id: str, *, broker_run: str | None = None) -> Finding:
    """What the PS of this run says: is it there, and does it expect this site? `broker_run`: the run the
    broker's certificate names, if it names one (the broker would silently show nothing of another run)."""
    if broker_run is not None and broker_run != run_id:
        return failed(RUN, f"the site config says run {run_id!r}, the broker serves run {broker_run!r} (its "
                      "certificate says so)", f"Set run_id = \"{broker_run}\" in the site config: the federation's "
                      "run id, as in the PS config.", run_id=run_id, broker_run=broker_run)
    if seen.status_refused:
        return failed(RUN, f"the broker does not let this site read the status of run {run_id!r}",
                      f"run_id in the site config must be the federation's (the PS config's run_id, `fedmqtt broker "
                      f"init --run-id`). ({seen.status_refused})", run_id=run_id)
    if not seen.statuses:
        why = f" (one could not be read: {seen.unreadable})" if seen.unreadable else ""
        return warned(RUN, f"no status of run {run_id!r} on the broker{why}", "Either the PS has not started yet "
                      "(the agent waits for it: nothing to do), or run_id differs from the PS config's: compare "
                      "them.", run_id=run_id)
    status = max((s for s, _ in seen.statuses), key=lambda s: s.sent_at)
    online = f"{len(status.sites_online)} of {len(status.sites_expected)} sites online"
    facts = {"run_id": run_id, "ps_state": status.state, "round": status.round, "rounds": status.rounds_total,
             "sites_expected": list(status.sites_expected), "sites_online": list(status.sites_online)}
    if status.state in ("offline", "error", "done"):
        detail = f": {status.detail}" if status.detail else ""
        fix = {"offline": "The agent waits for the PS: nothing to do here unless it stays down (ask the "
                          "coordinating team).",
               "done": "A site started now waits for a new start of the run: ask the coordinating team whether one "
                       "is planned.",
               "error": "The PS stopped on an error: the coordinating team has its log."}[status.state]
        return warned(RUN, f"the PS of run {run_id!r} is {status.state}{detail}", fix, **facts)
    if site_id not in status.sites_expected:
        return failed(RUN, f"the PS of run {run_id!r} expects {', '.join(status.sites_expected) or 'no site'}; "
                      f"not {site_id}", f"Ask the coordinating team to add {site_id} to sites in the PS config "
                      "(and `fedmqtt broker add-site` if it has no login yet).", **facts)
    here = "; this site's agent is online" if site_id in status.sites_online else ""
    phase = status.state.replace("_", " ")
    rounds = f", round {status.round}/{status.rounds_total}" if status.state != "waiting_for_sites" else ""
    return passed(RUN, f"PS {phase}{rounds}; expects this site; {online}{here}", **facts)
