"""What secure aggregation's keys are bound to (fedmqtt/secagg/kdf.py, context.py): the same inputs give the same
key at both ends of a pair, and any other run, round, site, pair or purpose gives another."""

from __future__ import annotations

import os

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedmqtt.secagg import kdf
from fedmqtt.secagg.adverts import public_raw, usable_public
from fedmqtt.secagg.context import RoundContext, framed

CTX = RoundContext("kdf-run", 3)


def test_framing_is_unambiguous() -> None:
    assert framed("ab", "c") != framed("a", "bc")
    assert framed("a", "") != framed("a")
    assert framed(1) != framed("1") != framed(b"\x00" * 7 + b"\x01")
    assert CTX.bind("x", "site-1", "site-2") != CTX.bind("x", "site-12", "-2")


def test_both_ends_of_a_pair_derive_the_same_mask_key_and_nothing_else_does() -> None:
    a, b, c = (X25519PrivateKey.generate() for _ in range(3))
    shared = kdf.agree(a, public_raw(b))
    assert shared == kdf.agree(b, public_raw(a))
    key = kdf.pair_mask_key(CTX, shared, "site-a", "site-b")
    assert key == kdf.pair_mask_key(CTX, kdf.agree(b, public_raw(a)), "site-b", "site-a")
    others = {
        kdf.pair_mask_key(RoundContext("kdf-run", 4), shared, "site-a", "site-b"),
        kdf.pair_mask_key(RoundContext("kdf-run-2", 3), shared, "site-a", "site-b"),
        kdf.pair_mask_key(CTX, shared, "site-a", "site-c"),
        kdf.pair_mask_key(CTX, kdf.agree(a, public_raw(c)), "site-a", "site-b"),
        kdf.share_key(CTX, shared, "site-a", "site-b"),
        kdf.share_key(CTX, shared, "site-b", "site-a"),  # one key a direction
    }
    assert key not in others and len(others) == 6


def test_a_mask_key_comes_from_its_seed_site_and_round() -> None:
    seed = os.urandom(16)
    key = public_raw(kdf.mask_private_key(CTX, seed, "site-a"))
    assert key == public_raw(kdf.mask_private_key(CTX, seed, "site-a"))
    assert key != public_raw(kdf.mask_private_key(CTX, seed, "site-b"))
    assert key != public_raw(kdf.mask_private_key(RoundContext("kdf-run", 4), seed, "site-a"))
    assert key != public_raw(kdf.mask_private_key(CTX, os.urandom(16), "site-a"))


def test_seed_commitments_and_self_masks_are_bound_to_their_site() -> None:
    seed = os.urandom(16)
    assert kdf.seed_commitment(CTX, seed, "site-a") != kdf.seed_commitment(CTX, seed, "site-b")
    assert kdf.self_mask_key(CTX, seed, "site-a") != kdf.self_mask_key(CTX, seed, "site-b")
    assert kdf.self_mask_key(CTX, seed, "site-a") != kdf.seed_commitment(CTX, seed, "site-a")


def test_low_order_points_are_not_usable_keys() -> None:
    assert usable_public(public_raw(X25519PrivateKey.generate()))
    assert not usable_public(bytes(32))  # u = 0
    assert not usable_public((1).to_bytes(32, "little"))  # u = 1
