"""docs/protocol.md's tables of limits, states, timers and reason codes: the constants themselves."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from fedmqtt import logs
from fedmqtt.docgen.tables import code, size, table
from fedmqtt.transport import bulk, reasons
from fedmqtt.transport.settings import BrokerSettings
from ps_daemon import admission, status
from ps_daemon.config import DaemonConfig
from schemas import chunks


def _setting(name: str) -> tuple[str, object, str]:
    field = BrokerSettings.model_fields[name]
    return code(f"[broker] {name}"), _size(field.default), field.description or ""


def _size(value: object) -> str:
    return str(value) if size(value) == str(value) else f"{value} ({size(value)})"


def chunk_limits_table() -> str:
    settings = ("chunk_threshold_bytes", "chunk_bytes", "fetch_window_bytes", "chunk_stall_s",
                "chunk_refetches", "max_pending_chunk_bytes", "max_pending_manifests",
                "chunk_min_rate_bytes_per_s",
                "max_payload_bytes")
    rows = [_setting(name) for name in settings]
    rows += [
        (code("MIN_CHUNK_BYTES"), _size(chunks.MIN_CHUNK_BYTES), "smallest chunk a manifest may declare"),
        (code("MAX_CHUNK_BYTES"), _size(chunks.MAX_CHUNK_BYTES),
         "largest chunk: keeps every MQTT packet under the broker's max_packet_size"),
        (code("MAX_CHUNKS"), chunks.MAX_CHUNKS,
         "chunks per transfer: the broker's ACL lists exactly this many chunk topics per topic, and a payload "
         "that needs more chunks of chunk_bytes travels in this many larger ones"),
        (code("MAX_CHUNKED_BYTES"), _size(chunks.MAX_CHUNKED_BYTES),
         "the most one chunked transfer carries (MAX_CHUNKS x MAX_CHUNK_BYTES)"),
        (code("MAX_WINDOW_CHUNKS"), bulk.MAX_WINDOW_CHUNKS,
         "chunk topics subscribed at once, whatever their size"),
        (code("CHUNKED_UPDATE_SLACK_BYTES"), _size(admission.CHUNKED_UPDATE_SLACK_BYTES),
         "the PS refuses a chunked update declaring more than the model's size plus this (control variates, "
         "layer statistics)"),
    ]
    return table(("Setting or constant", "Value (default)", "Meaning"), rows)


def states(model: type[BaseModel]) -> str:
    """The values of a status model's `state` Literal, in its order."""
    return ", ".join(code(s) for s in typing.get_args(model.model_fields["state"].annotation))


def timing_table() -> str:
    fields = DaemonConfig.model_fields
    rows: list[tuple[str, object, str]] = [
        (code(name), fields[name].default, fields[name].description or "")
        for name in ("round_timeout_s", "stall_s")]
    rows += [
        (code("REMIND_S"), status.REMIND_S,
         "a waiting PS logs what it waits for, and who is missing, at least this often"),
        (code("STATUS_REFRESH_S"), status.STATUS_REFRESH_S,
         "new refusal counts reach ps/status at most this often"),
        (code("REFUSAL_SUMMARY_S"), logs.REFUSAL_SUMMARY_S,
         f"refusals beyond the first {logs.REFUSALS_VERBATIM} per sender and category are logged as one summary "
         "line per sender this often"),
    ]
    return table(("Setting", "Default (s)", "Meaning"), rows)


_NAMES_PAHO_LACKS = {0x92: "Packet identifier not found"}


def _code_name(code_value: int) -> str:
    return _NAMES_PAHO_LACKS.get(code_value) or reasons.code_name(code_value)


def reason_codes_table() -> str:
    rows = [(f"0x{c:02X}", _code_name(c), "transient", "wait and retry with backoff "
             f"({reasons.backoff_s(0)} s doubling up to {reasons.backoff_s(99)} s); logged as transient")
            for c in sorted(reasons.TRANSIENT_CODES)]
    rows += [(f"0x{c:02X}", _code_name(c), "permanent",
              "stop and say what to change: " + fix.format(user="<user>", broker="<host:port>"))
             for c, fix in sorted(reasons.FIXES.items())]
    return table(("Code", "Name", "Kind", "What the client does"), rows)

