"""Login throttling, decided before a password is hashed: per client address and for the whole server.

scrypt costs ~0.1 s of CPU and 32 MiB per check, so a throttle that counts failures after the check lets a burst
of concurrent guesses run every check. Here each attempt is admitted or refused first, and an admitted one is
counted as a failure straight away (a success then clears it), so concurrent attempts see each other.

Per address (an IPv6 client's whole /64, which one host usually holds): `FREE_FAILURES` wrong passwords in a
row, then a lockout of 1 s that doubles with each further failure up to `LOCK_CAP_S`; the right password works
as soon as the lockout is over and clears the count, and a quiet `FORGET_AFTER_S` clears it too. For the whole
server: a token bucket of `GLOBAL_BURST` checks refilled at `GLOBAL_PER_S`, which bounds the CPU a spray from many
addresses can take (at worst it delays the operator's own login by a second or two, never locks it out for long).
A refusal says when to come back (HTTP 429 with Retry-After). Used from the event loop only: no lock needed.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

FREE_FAILURES = 5  # wrong passwords in a row per address before the first lockout
FIRST_LOCK_S = 1.0  # the first lockout; each further failure doubles it
LOCK_CAP_S = 60.0  # the longest lockout: the right password always gets a try within a minute
FORGET_AFTER_S = 15 * 60.0  # an address quiet this long starts again from zero failures
GLOBAL_BURST = 10  # hash checks the whole server runs back to back
GLOBAL_PER_S = 2.0  # then this many per second (~0.2 of one core on scrypt)
MAX_ADDRESSES = 10_000  # addresses remembered; the least recently seen is forgotten first


def lock_seconds(failures: int) -> float:
    """The lockout after `failures` wrong passwords in a row (0 below FREE_FAILURES)."""
    if failures < FREE_FAILURES:
        return 0.0
    return min(LOCK_CAP_S, FIRST_LOCK_S * 2.0 ** min(failures - FREE_FAILURES, 16))


def address_key(client: str) -> str:
    """Who is counted: an IPv4 address, an IPv6 client's /64, or the raw peer name for anything else."""
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return client
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


@dataclass
class _Address:
    failures: int = 0  # in a row; an admitted attempt counts until it succeeds
    locked_until: float = 0.0
    last_seen: float = 0.0


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    retry_after_s: int = 0  # whole seconds (>= 1) when refused
    reason: str = ""  # "address" or "server" when refused


class LoginThrottle:
    def __init__(self, now: float | None = None) -> None:
        self.addresses: OrderedDict[str, _Address] = OrderedDict()
        self.tokens = float(GLOBAL_BURST)
        self.refilled_at = time.monotonic() if now is None else now

    def admit(self, client: str, now: float | None = None) -> Verdict:
        """Whether `client` may have its password checked now; if so, the attempt is counted as a failure."""
        now = time.monotonic() if now is None else now
        key = address_key(client)
        entry = self.addresses.pop(key, None)
        if entry is None or now - entry.last_seen > FORGET_AFTER_S:
            entry = _Address()
        entry.last_seen = now
        self._remember(key, entry)
        if entry.locked_until > now:
            return Verdict(False, _whole(entry.locked_until - now), "address")
        self.tokens = min(float(GLOBAL_BURST), self.tokens + (now - self.refilled_at) * GLOBAL_PER_S)
        self.refilled_at = now
        if self.tokens < 1.0:
            return Verdict(False, _whole((1.0 - self.tokens) / GLOBAL_PER_S), "server")
        self.tokens -= 1.0
        entry.failures += 1
        entry.locked_until = now + lock_seconds(entry.failures)
        return Verdict(True)

    def succeeded(self, client: str) -> None:
        """The right password: the address starts again from zero failures."""
        self.addresses.pop(address_key(client), None)

    def failures(self, client: str) -> int:
        entry = self.addresses.get(address_key(client))
        return entry.failures if entry is not None else 0

    def _remember(self, key: str, entry: _Address) -> None:
        self.addresses[key] = entry  # newest last
        while len(self.addresses) > MAX_ADDRESSES:
            self.addresses.popitem(last=False)


def _whole(seconds: float) -> int:
    return max(1, math.ceil(seconds))
