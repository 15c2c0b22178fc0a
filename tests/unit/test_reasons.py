"""The sorting of broker reason codes: transient ones are retried with a bounded backoff, permanent ones carry a
fix (the wording of each fix is checked against a real broker in tests/integration/test_reason_codes.py)."""

from __future__ import annotations

from fedmqtt.transport import reasons


def test_a_code_is_either_retried_or_explained_never_both() -> None:
    """A fix for a transient code would never be shown: explain() says 'retrying' for those instead."""
    assert not reasons.TRANSIENT_CODES & reasons.FIXES.keys()
    assert all(code >= 0x80 for code in (*reasons.TRANSIENT_CODES, *reasons.FIXES))


def test_every_permanent_disconnect_names_its_fix() -> None:
    assert not reasons.PERMANENT_DISCONNECTS & reasons.TRANSIENT_CODES
    for code in reasons.PERMANENT_DISCONNECTS:
        text = reasons.explain("the connection", code, user="site-a", broker="b:1883")
        assert reasons.FIXES[code].format(user="site-a", broker="b:1883") in text, hex(code)


def test_backoff_doubles_from_half_a_second_up_to_its_cap() -> None:
    waits = [reasons.backoff_s(attempt) for attempt in range(12)]
    assert waits[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert waits[5:] == [reasons.MAX_BACKOFF_S] * 7


def test_reason_code_names_a_code_whatever_packet_type_paho_files_it_under() -> None:
    """0x97 (quota exceeded) is a PUBACK/PUBREC code, 0x8E (session taken over) a DISCONNECT code, 0x85 (client
    id not valid) a CONNACK code; a code paho does not know becomes 'unspecified error'."""
    assert reasons.reason_code(0x97).value == 0x97
    assert reasons.reason_code(0x8E).getName() == reasons.code_name(0x8E) == "Session taken over"
    assert reasons.reason_code(0x85).value == 0x85
    assert reasons.reason_code(0xFF).value == 0x80
