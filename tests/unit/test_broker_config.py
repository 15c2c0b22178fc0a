"""Rendering a federation's mosquitto.conf from the base file."""

from __future__ import annotations

import socket
from pathlib import Path

from broker.config import base_config_path, free_port, render_broker_config


def _directives(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_rendered_config_appends_federation_lines(tmp_path: Path) -> None:
    """Listener, password file, ACL, persistence dir (trailing slash) and log file follow the base file."""
    # Prepare
    paths = {
        "password_file": tmp_path / "passwd",
        "acl_file": tmp_path / "acl",
        "persistence_dir": tmp_path / "data",
    }

    # Execute
    text = render_broker_config(port=18999, log_file=tmp_path / "mosquitto.log", user="fed", **paths)

    # Assert
    lines = _directives(text)
    assert lines[-6:] == [
        "listener 18999 127.0.0.1",
        f"password_file {tmp_path / 'passwd'}",
        f"acl_file {tmp_path / 'acl'}",
        f"persistence_location {tmp_path / 'data'}/",
        f"log_dest file {tmp_path / 'mosquitto.log'}",
        "user fed",
    ]
    assert text.index("# federation-specific") > text.index("allow_anonymous false")


def test_rendered_config_keeps_the_base_settings(tmp_path: Path) -> None:
    """Security, size, queue and persistence settings of the base file survive rendering unchanged."""
    # Prepare
    base = _directives(base_config_path().read_text(encoding="utf-8"))

    # Execute
    text = render_broker_config(
        port=1883, password_file=tmp_path / "p", acl_file=tmp_path / "a", persistence_dir=tmp_path / "d"
    )

    # Assert
    lines = _directives(text)
    assert lines[: len(base)] == base
    for setting in (
        "allow_anonymous false",
        "per_listener_settings false",
        "persistence true",
        "max_packet_size 12648448",
        "message_size_limit 12582912",
        "max_queued_messages 1000",
        "persistent_client_expiration 7d",
        "retain_available true",
    ):
        assert setting in lines
    assert "log_dest stdout" in lines  # no log file given


def test_base_config_leaves_per_federation_directives_out() -> None:
    """The base file has no listener, auth-file or persistence-location lines: the renderer owns them."""
    # Execute
    keys = {line.split()[0] for line in _directives(base_config_path().read_text(encoding="utf-8"))}

    # Assert
    assert not keys & {
        "listener",
        "port",
        "password_file",
        "acl_file",
        "persistence_location",
        "log_dest",
        "user",
    }


def test_free_port_is_bindable() -> None:
    """free_port returns a port that can be bound right away on loopback."""
    # Execute
    port = free_port()

    # Assert
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
