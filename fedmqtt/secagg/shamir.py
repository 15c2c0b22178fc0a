"""Shamir secret sharing of 16-byte secrets, with pycryptodome's `Shamir` (over GF(2^128)).

The secrets a site shares are 128-bit seeds: the seed of its round's X25519 mask key (the key is derived from it,
fedmqtt/secagg/kdf.py) and the seed of its self-mask. 128 bits match X25519's security level, and one field
element a secret keeps the PS's reconstruction (pure Python in pycryptodome) at one interpolation a secret. Any t
shares give the secret back; t - 1 shares are uniform and independent of it (a degree t - 1 polynomial with
uniformly random coefficients besides the secret).

Shamir's scheme has no integrity: shares from a site that lies rebuild a wrong secret. `reconstruct` is handed
a check (the advertised public key, the seed commitment) and tries subsets of t shares until one passes it. When
the first subset fails (someone lied), it then names every share that disagrees with the secret found: with t - 1
shares of the consistent subset and one more, the secret comes out right exactly when that share lies on the
polynomial (its Lagrange coefficient at 0 is never zero). When the first subset passes, the other shares are not
examined: they change nothing, and pycryptodome's GF(2^128) arithmetic is pure Python, so checking them would
cost the PS (n - t) interpolations a secret.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from Crypto.Protocol.SecretSharing import Shamir

SECRET_BYTES = 16
SHARE_BYTES = SECRET_BYTES
MAX_SUBSETS = 256  # subsets of t answers tried before the PS gives a secret up as unrecoverable


def split(secret: bytes, threshold: int, holders: int) -> list[bytes]:
    """`holders` shares of `secret`, the share with x-coordinate i + 1 at position i; any `threshold` rebuild it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a shared secret has {SECRET_BYTES} bytes, not {len(secret)}")
    if not 1 <= threshold <= holders:
        raise ValueError(f"threshold {threshold} must be in [1, {holders}]")
    return [share for _, share in Shamir.split(threshold, holders, secret)]


def combine(shares: Mapping[int, bytes]) -> bytes:
    """The secret through exactly these shares (x-coordinate -> share); all of them are used."""
    if any(len(s) != SHARE_BYTES for s in shares.values()) or any(x < 1 for x in shares):
        raise ValueError(f"a share is {SHARE_BYTES} bytes at an x-coordinate >= 1")
    return Shamir.combine(sorted(shares.items()))


@dataclass(frozen=True)
class Reconstruction:
    """A rebuilt secret and the holders whose shares disagree with it; or None and why (then nobody is named: with
    no consistent subset found, there is no telling whose shares are off)."""

    secret: bytes | None
    bad_holders: tuple[str, ...]
    reason: str = ""


def _candidate_subsets(holders: list[str], size: int) -> Iterator[tuple[str, ...]]:
    """Subsets of `size` holders to try, in a fixed order: first the cyclic windows of the sorted holders (one of
    them avoids every liar whenever the liars leave `size` consecutive honest holders, e.g. a single liar), then
    subsets drawn by a fixed-seed generator (a search order, not a secret)."""
    seen: set[tuple[str, ...]] = set()
    m = len(holders)
    windows = (tuple(sorted(holders[(start + i) % m] for i in range(size))) for start in range(m))
    search = random.Random(0)
    drawn = (tuple(sorted(search.sample(holders, size))) for _ in itertools.count())
    for subset in itertools.chain(windows, drawn):
        if subset not in seen:
            seen.add(subset)
            yield subset
        if len(seen) == math.comb(m, size):
            return


def reconstruct(answers: Mapping[str, tuple[int, bytes]], threshold: int, check: Callable[[bytes], bool], *,
                max_subsets: int = MAX_SUBSETS) -> Reconstruction:
    """The secret that `check` accepts, from the holders' answers (holder -> (x-coordinate, share)).

    Tries at most `max_subsets` subsets of `threshold` answers (`_candidate_subsets`).
    """
    holders = sorted(answers)
    if len(holders) < threshold:
        return Reconstruction(None, (), f"{len(holders)} shares, {threshold} needed")
    for tried, subset in enumerate(itertools.islice(_candidate_subsets(holders, threshold), max_subsets)):
        secret = combine({answers[h][0]: answers[h][1] for h in subset})
        if not check(secret):
            continue
        if tried == 0:
            return Reconstruction(secret, ())
        base = {answers[h][0]: answers[h][1] for h in subset[1:]}
        bad = tuple(h for h in holders if h not in subset and combine({**base, answers[h][0]: answers[h][1]})
                    != secret)
        return Reconstruction(secret, bad)
    return Reconstruction(None, (), f"no {threshold} of the {len(holders)} shares rebuild a secret "
                          f"that matches its commitment (tried {min(max_subsets, math.comb(len(holders), threshold))} "
                          "subsets)")

