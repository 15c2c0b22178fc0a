"""Which round of which run a secure aggregation message belongs to, and its unambiguous byte form.

Every derived key, every AEAD's associated data, every signed key advertisement and every seed commitment binds
this context (and the site ids involved), so nothing produced for one round, run or pair of sites can be used in
another. Fields are length-prefixed, so no two different tuples encode to the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

PROTOCOL_LABEL = b"fedmqtt secagg+ v1"


def framed(*fields: bytes | str | int) -> bytes:
    """The fields, each with a 4-byte big-endian length first (ints as 8 bytes big-endian)."""
    out = bytearray()
    for value in fields:
        raw = value.encode("utf-8") if isinstance(value, str) else value.to_bytes(8, "big") if isinstance(
            value, int) else bytes(value)
        out += len(raw).to_bytes(4, "big") + raw
    return bytes(out)


@dataclass(frozen=True)
class RoundContext:
    """One round of one run: what every secret of secure aggregation is bound to."""

    run_id: str
    round_no: int
    # Which try of the round (the PS starts a new one after a failed round or a restart, with fresh secrets at
    # every site): bound in as well when set, so nothing of one try is taken in another.
    attempt: int = 0

    def bind(self, purpose: str, *parts: str | bytes) -> bytes:
        """The protocol label, this context, a purpose and the parts (site ids, keys), as one byte string."""
        tried = (self.attempt,) if self.attempt else ()
        return framed(PROTOCOL_LABEL, purpose, self.run_id, self.round_no, *tried, *parts)

    def advert_label(self) -> str:
        """The label an advertisement is signed under (in place of a topic: never a topic of the wire)."""
        tried = f":{self.attempt}" if self.attempt else ""
        return f"secagg-advert:{self.run_id}:{self.round_no}{tried}"
