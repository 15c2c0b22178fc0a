"""Secure aggregation's primitives against their published test vectors, through the exact calls the protocol
makes: X25519 (RFC 7748 section 6.1) via `kdf.agree`, HKDF-SHA256 (RFC 5869 A.1 and A.3) via `kdf.hkdf`'s
construction, the ChaCha20 keystream (RFC 8439 2.4.2 and A.1 #1) via `stream.keystream` and `stream.expand`, and
ChaCha20-Poly1305 (RFC 8439 2.8.2) via `sealing.aead_encrypt` / `aead_decrypt`."""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedmqtt.secagg import kdf
from fedmqtt.secagg.adverts import public_raw
from fedmqtt.secagg.sealing import aead_decrypt, aead_encrypt
from fedmqtt.secagg.stream import expand, keystream

H = bytes.fromhex
SUNSCREEN = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, "
             b"sunscreen would be it.")


def test_x25519_rfc7748_section_6_1_both_directions() -> None:
    alice = X25519PrivateKey.from_private_bytes(
        H("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"))
    bob = X25519PrivateKey.from_private_bytes(H("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb"))
    assert public_raw(alice) == H("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
    assert public_raw(bob) == H("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
    shared = H("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")
    assert kdf.agree(alice, public_raw(bob)) == shared
    assert kdf.agree(bob, public_raw(alice)) == shared


def test_hkdf_sha256_rfc5869_a1_with_salt() -> None:
    """A.1 has a salt; `kdf.hkdf` uses none, so A.1 checks the same HKDF class and hash with the RFC's salt."""
    okm = HKDF(algorithm=hashes.SHA256(), length=42, salt=H("000102030405060708090a0b0c"),
               info=H("f0f1f2f3f4f5f6f7f8f9")).derive(b"\x0b" * 22)
    assert okm == H("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")


def test_hkdf_sha256_rfc5869_a3_no_salt_is_kdf_hkdf() -> None:
    """A.3: no salt, empty info, the exact call `kdf.hkdf` makes."""
    assert kdf.hkdf(b"\x0b" * 22, b"", 42) == H(
        "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8")


def test_chacha20_rfc8439_a1_vector_1_is_expand_with_the_zero_nonce() -> None:
    """All-zero key, nonce and counter: the nonce and counter `stream.expand` uses for every mask."""
    block = H("76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
              "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586")
    assert keystream(bytes(32), 64) == block
    assert np.array_equal(expand(bytes(32), 16, np.uint32), np.frombuffer(block, dtype="<u4"))
    assert np.array_equal(expand(bytes(32), 8, np.uint64), np.frombuffer(block, dtype="<u8"))


def test_chacha20_rfc8439_2_4_2_sunscreen() -> None:
    """Key 00..1f, counter 1, nonce 00:00:00:00:00:00:00:4a:00:00:00:00 (cryptography's 16-byte nonce is the
    little-endian counter then the RFC nonce)."""
    nonce = (1).to_bytes(4, "little") + H("000000000000004a00000000")
    stream = keystream(bytes(range(32)), len(SUNSCREEN), nonce=nonce)
    cipher = bytes(a ^ b for a, b in zip(SUNSCREEN, stream, strict=True))
    assert cipher == H("6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
                       "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
                       "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
                       "5af90bbf74a35be6b40b8eedf2785e42874d")


def test_chacha20_poly1305_rfc8439_2_8_2() -> None:
    key = H("808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f")
    nonce, associated = H("070000004041424344454647"), H("50515253c0c1c2c3c4c5c6c7")
    sealed = aead_encrypt(key, SUNSCREEN, associated, nonce=nonce)
    assert sealed == H("d31a8d34648e60db7b86afbc53ef7ec2a4aded51296e08fea9e2b5a736ee62d6"
                       "3dbea45e8ca9671282fafb69da92728b1a71de0a9e060b2905d6a5b67ecd3b36"
                       "92ddbd7f2d778b8c9803aee328091b58fab324e4fad675945585808b4831d7bc"
                       "3ff4def08e4b7a9de576d26586cec64b6116" "1ae10b594f09e26a7e902ecbd0600691")
    assert aead_decrypt(key, sealed, associated, nonce=nonce) == SUNSCREEN
    assert aead_decrypt(key, sealed, associated[:-1] + b"\x00", nonce=nonce) is None
    assert aead_decrypt(key, bytes([sealed[0] ^ 1]) + sealed[1:], associated, nonce=nonce) is None
