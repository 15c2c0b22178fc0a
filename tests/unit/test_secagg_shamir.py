"""Shamir sharing of secure aggregation's 16-byte seeds (fedmqtt/secagg/shamir.py): any t shares rebuild the
secret, t - 1 shares say nothing about it, and a lying share is found and named."""

from __future__ import annotations

import itertools
import os
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmqtt.secagg import shamir


@settings(max_examples=30, deadline=None)
@given(secret=st.binary(min_size=16, max_size=16), holders=st.integers(1, 9), data=st.data())
def test_any_t_shares_rebuild_the_secret(secret: bytes, holders: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, holders))
    shares = shamir.split(secret, t, holders)
    for subset in itertools.islice(itertools.combinations(range(holders), t), 20):
        assert shamir.combine({i + 1: shares[i] for i in subset}) == secret


def test_t_minus_one_shares_give_another_secret() -> None:
    secret = os.urandom(16)
    shares = shamir.split(secret, 4, 7)
    assert shamir.combine({i + 1: shares[i] for i in range(3)}) != secret


def test_t_minus_one_shares_are_uniform_whatever_the_secret() -> None:
    """For two fixed, very different secrets, the first byte of each of t - 1 = 2 shares is uniform (chi-square,
    256 cells, 4096 draws; the critical value of chi2(255) at p = 1e-6 is 377) and the two secrets' share byte
    histograms are alike. A deterministic or secret-dependent share would fail both."""
    draws = 4096
    expected = draws / 256
    for secret in (bytes(16), b"\xff" * 16):
        splits = [shamir.split(secret, 3, 5) for _ in range(draws)]
        cells = {f"holder {h}": Counter(s[h][0] for s in splits) for h in range(2)}
        cells["both, xor"] = Counter(s[0][0] ^ s[1][0] for s in splits)  # jointly too, not only one at a time
        for name, counts in cells.items():
            chi2 = sum((counts.get(v, 0) - expected) ** 2 / expected for v in range(256))
            assert chi2 < 377.1, (secret[:1], name, chi2)


def test_reconstruct_names_a_lying_holder() -> None:
    secret = os.urandom(16)
    shares = shamir.split(secret, 3, 6)
    answers = {f"h{i}": (i + 1, shares[i]) for i in range(6)}
    answers["h0"] = (1, bytes(a ^ 1 for a in shares[0]))  # in the first subset tried
    result = shamir.reconstruct(answers, 3, lambda s: s == secret)
    assert result.secret == secret and result.bad_holders == ("h0",)


def test_reconstruct_finds_the_secret_past_several_liars_among_many_holders() -> None:
    """20 holders, t = 11, liars first and in the middle: a fixed lexicographic search would try C(19, 10) subsets
    before leaving out the first holder; the search order finds a clean subset within its budget."""
    secret = os.urandom(16)
    shares = shamir.split(secret, 11, 20)
    answers = {f"h{i:02d}": (i + 1, shares[i]) for i in range(20)}
    for liar in ("h00", "h09"):
        index, share = answers[liar]
        answers[liar] = (index, bytes(b ^ 0x5A for b in share))
    result = shamir.reconstruct(answers, 11, lambda s: s == secret)
    assert result.secret == secret and result.bad_holders == ("h00", "h09")


def test_reconstruct_fails_safe_without_enough_honest_shares() -> None:
    secret = os.urandom(16)
    shares = shamir.split(secret, 3, 4)
    answers = {f"h{i}": (i + 1, os.urandom(16) if i < 2 else shares[i]) for i in range(4)}
    result = shamir.reconstruct(answers, 3, lambda s: s == secret)
    assert result.secret is None and "no 3 of the 4" in result.reason and "tried 4 subsets" in result.reason
    assert result.bad_holders == ()  # no consistent subset: no telling who lied
    few = shamir.reconstruct({"h0": (1, shares[0])}, 3, lambda s: s == secret)
    assert few.secret is None and "1 shares, 3 needed" in few.reason


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        shamir.split(bytes(15), 2, 3)
    with pytest.raises(ValueError):
        shamir.split(bytes(16), 4, 3)
    with pytest.raises(ValueError):
        shamir.combine({0: bytes(16)})
