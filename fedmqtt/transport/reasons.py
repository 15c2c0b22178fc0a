"""What the broker's MQTT v5 reason codes >= 0x80 mean for a client, and what to do about each.

Every code the broker sends (CONNACK, PUBACK/PUBREC/PUBCOMP, SUBACK, DISCONNECT) is either transient (retried
with exponential backoff, logged as such) or permanent (a `PermanentBrokerError` whose message names the cause
and the fix): see `TRANSIENT_CODES` and `FIXES`. The connection (fedmqtt.transport.mqtt) acts on the sorting;
docs/protocol.md lists it.
"""

from __future__ import annotations

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

# Reason codes that describe a passing state of the broker: wait and try again. Everything else >= 0x80 is
# permanent: the same request would be refused again, so we stop and say what to change.
TRANSIENT_CODES = frozenset({
    0x80,  # unspecified error: Mosquitto uses it for internal hiccups (e.g. out of memory)
    0x83,  # implementation specific error: a plugin's temporary failure
    0x88,  # server unavailable
    0x89,  # server busy
    0x8B,  # server shutting down (DISCONNECT): it comes back
    0x8D,  # keep alive timeout (DISCONNECT): the network stalled; reconnect
    0x91,  # packet identifier in use: re-send under a new one
    0x92,  # packet identifier not found (e.g. after a broker restart lost the QoS 2 state): re-send
    0x93,  # receive maximum exceeded (DISCONNECT): reconnect; unacknowledged messages are re-sent
    0x96,  # message rate too high
    0x97,  # quota exceeded: the broker's in-flight/queue budget is full for now
    0x9F,  # connection rate exceeded
    0xA0,  # maximum connect time (DISCONNECT): the broker limits a connection's lifetime; reconnect
})
# DISCONNECT codes that the broker sends on purpose and that a reconnect would only repeat. A socket that
# just broke is reported by paho as 0x80 and is retried.
PERMANENT_DISCONNECTS = frozenset({0x87, 0x8A, 0x8E, 0x95, 0x98, 0x9C, 0x9D})
MAX_BACKOFF_S = 15.0  # the longest wait between two tries (also paho's reconnect delay cap)

# Why a permanent code happened and what to change; {user} and {broker} are filled in.
_RUN_ID_FIX = ("The broker's ACL does not grant user {user!r} that topic: check that run_id in your config "
               "matches the federation's (fedmqtt broker init --run-id ...) and that this party uses its own "
               "credentials file.")
FIXES: dict[int, str] = {
    0x81: "The broker could not parse what we sent: check that the broker is Mosquitto 2.0 or later.",
    0x82: "The broker saw a protocol violation: check that the broker is Mosquitto 2.0 or later.",
    0x84: "The broker does not speak MQTT v5: use Mosquitto 2.0 or later.",
    0x85: "The broker refused the client id: check the broker's clientid_prefixes setting.",
    0x86: ("The broker does not know user {user!r} with this password: check the credentials file (use the one "
           "`fedmqtt broker init` wrote for this party; re-run init if the broker's password file was replaced)."),
    0x87: _RUN_ID_FIX,
    0x8A: "The broker banned this client: ask the broker's operator.",
    0x8C: ("The broker expects another authentication method: log in with the username/password from the "
           "credentials file written by `fedmqtt broker init`."),
    0x8E: ("Another connection logged in as {user!r} and the broker (use_username_as_clientid) closed ours: the "
           "same credentials are in use twice. Stop the other process; each party and tool needs its own "
           "credentials (observers: observer.1 ... observer.7 with the observer password)."),
    0x8F: "The topic filter is malformed: check run_id and site_id (1-63 of a-z, 0-9, '-').",
    0x90: "The topic name is malformed: check run_id and site_id (1-63 of a-z, 0-9, '-').",
    0x94: "The broker refused a topic alias: check that the broker is Mosquitto 2.0 or later.",
    0x95: ("The message is larger than the broker allows (message_size_limit / max_packet_size in "
           "mosquitto.conf): lower chunk_threshold_bytes and chunk_bytes in the [broker] settings below it."),
    0x98: "The broker's operator closed this connection on purpose (administrative action): ask them why.",
    0x99: "The broker refused the payload format: check that the broker is Mosquitto 2.0 or later.",
    0x9A: "The broker does not keep retained messages: set retain_available true in mosquitto.conf.",
    0x9B: "fedmqtt needs QoS 2: remove max_qos from mosquitto.conf.",
    0x9C: "The broker asks to use another server: point host/port in the [broker] settings at it.",
    0x9D: "The broker has moved: point host/port in the [broker] settings at its new address.",
    0x9E: "The broker does not support shared subscriptions: use Mosquitto 2.0 or later.",
    0xA1: "The broker does not support subscription identifiers: use Mosquitto 2.0 or later.",
    0xA2: "The broker does not support wildcard subscriptions: enable them (Mosquitto 2.0 default).",
}



def is_transient(code: int) -> bool:
    """True for a passing state of the broker (retry); False for a refusal that retrying would repeat."""
    return code in TRANSIENT_CODES


def explain(action: str, reason: ReasonCode | int, *, user: str, broker: str) -> str:
    """'<action> refused: <name> (0xNN). <fix>' for a reason code >= 0x80."""
    code = reason if isinstance(reason, int) else reason.value
    name = code_name(code) if isinstance(reason, int) else reason.getName()
    fix = advice(action, code, user=user, broker=broker)
    return f"{action} refused by the broker {broker}: {name.lower()} (0x{code:02X}). {fix}"


def advice(action: str, code: int, *, user: str, broker: str) -> str:
    """What to do about reason code `code` (>= 0x80) refusing `action`: the fix part of `explain`."""
    if is_transient(code):
        return "A transient condition of the broker: retrying with backoff."
    if code == 0x87 and action.startswith("connection"):
        return (f"The broker does not let user {user!r} connect: check the credentials file (username and "
                f"password in the [broker] settings must be those `fedmqtt broker init` wrote for this party).")
    return FIXES.get(code, "An unexpected refusal: see the broker's log.").format(user=user, broker=broker)


def code_name(code: int) -> str:
    """paho's name of a bare code, whichever packet type paho files it under."""
    for packet in (PacketTypes.PUBREC, PacketTypes.CONNACK, PacketTypes.SUBACK, PacketTypes.DISCONNECT):
        try:
            return ReasonCode(packet, identifier=code).getName()
        except (KeyError, ValueError):
            continue
    return "unknown reason code"


def backoff_s(attempt: int) -> float:
    """0.5, 1, 2, 4, 8, 15, 15 ... seconds: quick at first, capped so a long outage costs little."""
    return min(MAX_BACKOFF_S, 0.5 * 2 ** min(attempt, 10))


def reason_code(code: int) -> ReasonCode:
    """A ReasonCode for `code`, whichever packet type paho files it under (brokers use codes out of place)."""
    for packet in (PacketTypes.PUBREC, PacketTypes.DISCONNECT, PacketTypes.CONNACK, PacketTypes.SUBACK):
        try:
            return ReasonCode(packet, identifier=code)
        except (KeyError, ValueError):
            continue
    return ReasonCode(PacketTypes.PUBREC, identifier=0x80)  # unknown to paho: "unspecified error"
