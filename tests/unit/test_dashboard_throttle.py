"""The dashboard's login throttle (pure, its clock given): admitted or refused before the hash check, per
address and for the whole server, with a lockout that grows but stays short."""

from __future__ import annotations

from pathlib import Path

from fedmqtt.dashboard import throttle
from fedmqtt.dashboard.throttle import FREE_FAILURES, GLOBAL_BURST, GLOBAL_PER_S, LOCK_CAP_S, LoginThrottle


def test_an_admitted_attempt_counts_before_its_outcome_so_concurrent_ones_see_it() -> None:
    gate = LoginThrottle(now=0.0)
    verdicts = [gate.admit("10.0.0.1", now=0.0) for _ in range(30)]  # 30 at once: none has settled yet
    assert sum(v.allowed for v in verdicts) == FREE_FAILURES
    refused = [v for v in verdicts if not v.allowed]
    assert {v.reason for v in refused} == {"address"} and all(v.retry_after_s == 1 for v in refused)


def test_the_lockout_doubles_with_each_failure_up_to_a_minute_and_then_the_right_password_works() -> None:
    gate, now, waits = LoginThrottle(now=0.0), 0.0, []
    for _ in range(20):  # a patient guesser: each attempt as soon as allowed, each one wrong
        verdict = gate.admit("10.0.0.1", now=now)
        if not verdict.allowed:
            waits.append(verdict.retry_after_s)
            now += verdict.retry_after_s
            continue
        now += 0.1
    assert waits[:7] == [1, 2, 4, 8, 16, 32, 60] and max(waits) == LOCK_CAP_S
    assert gate.admit("10.0.0.1", now=now + LOCK_CAP_S).allowed  # the right password is checked within a minute
    gate.succeeded("10.0.0.1")  # ... and clears the count
    assert gate.failures("10.0.0.1") == 0
    assert all(gate.admit("10.0.0.1", now=now + LOCK_CAP_S + 1).allowed for _ in range(FREE_FAILURES - 1))


def test_a_quiet_address_is_forgiven() -> None:
    gate = LoginThrottle(now=0.0)
    for _ in range(FREE_FAILURES):
        gate.admit("10.0.0.1", now=0.0)
    assert not gate.admit("10.0.0.1", now=0.5).allowed
    assert gate.admit("10.0.0.1", now=throttle.FORGET_AFTER_S + 1).allowed
    assert gate.failures("10.0.0.1") == 1


def test_the_server_wide_bucket_bounds_a_spray_from_many_addresses() -> None:
    gate = LoginThrottle(now=0.0)
    verdicts = [gate.admit(f"10.0.{i // 250}.{i % 250}", now=0.0) for i in range(100)]
    assert sum(v.allowed for v in verdicts) == GLOBAL_BURST
    assert {v.reason for v in verdicts if not v.allowed} == {"server"}
    assert all(v.retry_after_s == 1 for v in verdicts if not v.allowed)
    # A minute of steady spraying: GLOBAL_PER_S checks per second, whoever asks.
    admitted = sum(gate.admit(f"10.1.{i % 200}.{i // 200}", now=t / 10).allowed for i, t in enumerate(range(1, 601)))
    assert admitted == int(60 * GLOBAL_PER_S)
    # A refused spray attempt costs the sprayer's address nothing, and the operator gets in after a second.
    assert gate.admit("192.0.2.7", now=61.0).allowed


def test_an_ipv6_client_is_counted_per_64_and_memory_is_bounded() -> None:
    gate = LoginThrottle(now=0.0)
    for i in range(FREE_FAILURES):
        assert gate.admit(f"2001:db8::{i + 1}", now=float(i)).allowed  # five addresses of one /64
    assert not gate.admit("2001:db8::ffff", now=4.5).allowed  # locked for 1 s after the fifth
    assert gate.admit("2001:db8:0:1::1", now=4.5).allowed  # the next /64 is someone else
    for i in range(throttle.MAX_ADDRESSES + 50):
        gate.addresses[f"k{i}"] = throttle._Address()
        gate._remember(f"k{i}", gate.addresses[f"k{i}"])
    assert len(gate.addresses) == throttle.MAX_ADDRESSES


def test_the_docs_state_these_numbers() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "dashboard.md").read_text(encoding="utf-8")
    for phrase in (f"{FREE_FAILURES} wrong passwords in a row", f"capped at {LOCK_CAP_S:g} s",
                   f"{GLOBAL_BURST} checks", f"{GLOBAL_PER_S:g} per second"):
        assert phrase in docs, phrase
