"""`fedmqtt topics ...`: look at a federation's traffic and at the payload schemas."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import typer

app = typer.Typer(help="Inspect MQTT traffic and payload schemas.", no_args_is_help=True)


@app.command("watch")
def watch(
    credentials: Path = typer.Option(..., "--credentials", help="A credentials TOML (its \\[broker] table), "
                                     "e.g. observer.toml."),
    run_id: str = typer.Option(..., "--run-id", help="The run whose messages to print."),
    count: int | None = typer.Option(None, help="Exit after this many messages."),
    timeout: float | None = typer.Option(None, help="Exit after this many seconds."),
    chunks: bool = typer.Option(False, "--chunks", help="Also print every chunk of a large model (one line each)."),
    seat: str | None = typer.Option(None, "--seat", help="Log in as <user>.<seat>: the broker allows one "
                                       "connection per login, so each extra watcher takes a seat (the observer "
                                       "has seats 1-7; default for it: 1)."),
) -> None:
    """Print every message of a run as one decoded line (never raw tensors). What you see depends on the ACL."""
    from fedmqtt.errors import FedMqttError
    from fedmqtt.summary import summarize
    from fedmqtt.transport import topics
    from fedmqtt.transport.channel import check_message
    from fedmqtt.transport.mqtt import MqttTransport
    from fedmqtt.transport.settings import load_credentials
    from fedmqtt.transport.signing import load_identity
    from schemas.signed import KeyList

    settings = load_credentials(credentials)
    ring = load_identity(credentials, run_id=run_id).ring  # what each signature is checked against
    if seat is None and settings.username == "observer":
        seat = "1"  # leave the plain observer login to the demo and scripts
    transport = MqttTransport(settings, client_id=f"fedmqtt-watch-{int(time.time() * 1000) % 10**9}", seat=seat)
    transport.connect()
    transport.subscribe([topics.run_filter(run_id)])
    seen, end = 0, None if timeout is None else time.monotonic() + timeout
    try:
        while (count is None or seen < count) and (end is None or time.monotonic() < end):
            raw = transport.get(0.2)
            if raw is None or not raw.payload:
                continue
            if "/chunk/" in raw.topic and not chunks:
                continue  # a chunked model is one manifest line; its chunks only with --chunks
            seen += 1
            stamp = datetime.now().strftime("%H:%M:%S")
            short = raw.topic.split("/", 3)[-1]
            try:
                _, msg = check_message(raw.topic, raw.payload, run_id=run_id, max_bytes=settings.max_payload_bytes,
                                       keys=ring)
                if isinstance(msg, KeyList):
                    ring.adopt(msg, raw.payload)  # a newer list: what is signed from now on is checked against it
                line = f"r{getattr(msg, 'round', '?')} {summarize(msg)}"
            except FedMqttError as exc:
                line = f"INVALID ({len(raw.payload)} B): {exc}"
            typer.echo(f"{stamp} {short:<28} {line}{' [retained]' if raw.retain else ''}")
    except KeyboardInterrupt:
        pass
    finally:
        transport.close()


@app.command("schema")
def schema() -> None:
    """Print the JSON Schema of every payload kind (for clients in other languages)."""
    from schemas.codec import json_schemas

    typer.echo(json.dumps(json_schemas(), indent=2))
