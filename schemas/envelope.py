"""How a signature travels with a payload (schemas/signed.py says what it signs), and taking it off again.

Taking it off is the first thing a receiver does with a payload, before the body is parsed: it is hostile input
like any other, so it is bounded and strict. JSON kinds end with exactly the member `seal` writes (matched by one
anchored expression on the last few hundred bytes); msgpack kinds start with exactly the two-entry map `seal`
writes and are unpacked with limits that leave no room for anything else. Anything else is "unsigned".

The msgpack form is a four-entry array, [signer, key id (8 bytes), signature (64 bytes), body]: positional rather than
a map with names, so that a signature costs its own 64 bytes plus about two dozen, not twice that.
"""

from __future__ import annotations

import base64
import re

import msgpack
from pydantic import ValidationError

from schemas.codec import MALFORMED, MAX_TEXT_BYTES, TOO_LARGE, WireError, clip, pack
from schemas.signed import Signature, SignedEnvelope

UNSIGNED = "unsigned"  # the refusal category of a payload without a signature
_TEXT_MEMBER = b',"signature":'
_TEXT_SUFFIX = re.compile(
    rb',"signature":\{"signer":"([a-z0-9][a-z0-9-]{0,62})","key_id":"([0-9a-f]{16})","ed25519":"([A-Za-z0-9_-]{86})"'
    rb"\}\}\Z")
_TEXT_TAIL = 256  # the suffix is at most ~220 bytes
_BINARY_PREFIX = b"\x94"  # msgpack: an array of 4 entries
OVERHEAD = 256  # what sealing adds at most, above the body's own budget


def seal(body: bytes, signature: Signature) -> bytes:
    """`body` (a message's own encoding) with `signature` attached, as it goes on the wire. A JSON object gets the
    member; anything else (msgpack, or bytes that are not what they claim, which the receiver will refuse after
    checking who signed them) the envelope."""
    if body[:1] == b"{" and body[-1:] == b"}" and len(body) >= 3:
        sig = base64.urlsafe_b64encode(signature.ed25519).rstrip(b"=").decode("ascii")
        member = (f'{_TEXT_MEMBER.decode()}{{"signer":"{signature.signer}","key_id":"{signature.key_id}",'
                  f'"ed25519":"{sig}"}}}}')
        return body[:-1] + member.encode("ascii")
    return pack([signature.signer, bytes.fromhex(signature.key_id), signature.ed25519, body])


def unseal(payload: bytes | bytearray, *, max_bytes: int) -> tuple[Signature, bytes]:
    """The signature and the body of a sealed payload; WireError ("unsigned", "too large", "malformed") otherwise.
    Nothing of the body is parsed here."""
    if len(payload) > max_bytes + OVERHEAD:
        raise WireError(TOO_LARGE, f"payload of {len(payload)} bytes exceeds the budget of {max_bytes} bytes")
    if payload[:1] == b"{":
        if len(payload) > MAX_TEXT_BYTES + OVERHEAD:  # refused by its size before a byte of it is hashed
            raise WireError(TOO_LARGE, f"JSON payload of {len(payload)} bytes exceeds {MAX_TEXT_BYTES} bytes")
        return _unseal_text(bytes(payload))
    if bytes(payload[:len(_BINARY_PREFIX)]) != _BINARY_PREFIX:
        raise WireError(UNSIGNED, "no signature: not a signed payload (every message but a chunk must be signed)")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=64,
                              max_array_len=4, max_map_len=0, max_ext_len=0)
        envelope = SignedEnvelope.model_validate(_named(obj))
    except (ValueError, TypeError, msgpack.UnpackException, ValidationError, RecursionError, MemoryError,
            OverflowError) as exc:
        category = TOO_LARGE if "exceeds max_" in str(exc) else MALFORMED
        raise WireError(category, f"malformed signed envelope: {type(exc).__name__}: {clip(exc)}") from None
    return envelope.signature, envelope.body


def _named(obj: object) -> dict[str, object]:
    """The positional envelope as SignedEnvelope's fields; anything but [str, 8 bytes, bytes, bytes] is malformed."""
    if not (isinstance(obj, list) and len(obj) == 4 and isinstance(obj[0], str) and isinstance(obj[1], bytes)
            and len(obj[1]) == 8):
        raise ValueError("not [signer, key id of 8 bytes, signature, body]")
    signer, key_id, signature, body = obj
    return {"signature": {"signer": signer, "key_id": key_id.hex(), "ed25519": signature}, "body": body}


def _unseal_text(payload: bytes) -> tuple[Signature, bytes]:
    start = max(0, len(payload) - _TEXT_TAIL)
    match = _TEXT_SUFFIX.search(payload, start)
    if match is None:
        raise WireError(UNSIGNED, "no signature: a JSON payload must end with its \"signature\" member")
    signer, key, sig = (g.decode("ascii") for g in match.groups())
    raw = base64.urlsafe_b64decode(sig + "==")
    if len(raw) != 64 or base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != sig:
        raise WireError(MALFORMED, "malformed signature: not the base64url text of 64 bytes")
    return Signature(signer=signer, key_id=key, ed25519=raw), payload[:match.start()] + b"}"
