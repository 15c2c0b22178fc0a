"""What the PS sees of one site, a masked input, is uniform in the ring and independent of the site's update.

Each check is run on the unmasked encoding too, where it must fail: a zero or weak mask would make the masked
input look like that, so none of these tests can pass without the masks doing their job.
"""

from __future__ import annotations

import numpy as np
from secagg_round import play

from fedmqtt.secagg.ring import FixedPoint

LENGTH = 1 << 15  # 32768 coordinates: 131072 bytes a masked input
# Critical values at p = 1e-6 (scipy.stats.chi2.isf), so that a correct mask fails a check about once in a million
# runs (the masks come from fresh random keys); a missing or weak mask fails them by orders of magnitude.
CHI2_255_CRITICAL = 377.1  # chi-square, 255 degrees of freedom
CHI2_15_CRITICAL = 56.5  # chi-square, 15 degrees of freedom
FIXED = FixedPoint(clip=4.0, fraction_bits=16, bits=32, max_sites=8)


def byte_chi2(vector: np.ndarray) -> float:
    counts = np.bincount(np.frombuffer(vector.tobytes(), dtype=np.uint8), minlength=256)
    expected = counts.sum() / 256
    return float(((counts - expected) ** 2 / expected).sum())


def test_a_masked_input_is_uniform_bytes_while_its_encoding_is_not() -> None:
    played = play(5, LENGTH, seed=3)
    for site, masked in played.server.masked.items():
        assert byte_chi2(masked.masked) < CHI2_255_CRITICAL, site
        assert byte_chi2(FIXED.encode(played.updates[site])) > 10 * CHI2_255_CRITICAL  # the control


def test_a_masked_input_is_uncorrelated_with_the_update() -> None:
    """Pearson correlation between the update and the masked input read as signed ring integers: near 0 (within
    5 standard errors of 1/sqrt(L), p < 1e-6), while the encoding itself correlates perfectly."""
    played = play(5, LENGTH, seed=4)
    for site, masked in played.server.masked.items():
        update = played.updates[site].astype(np.float64)
        seen = masked.masked.view(np.int32).astype(np.float64)
        assert abs(np.corrcoef(update, seen)[0, 1]) < 5 / np.sqrt(LENGTH), site
        plain = FIXED.encode(played.updates[site]).view(np.int32).astype(np.float64)
        assert np.corrcoef(update, plain)[0, 1] > 0.99  # the control


def test_the_masked_input_does_not_depend_on_which_update_was_masked() -> None:
    """Over 40 rounds, one site's masked input when its update is all -clip and when it is all +clip: the top 4 bits
    of every coordinate fall in the same 16 cells (chi-square test of homogeneity), and each is uniform; the
    encodings themselves are two constants."""
    low, high = np.full(256, -4.0, np.float32), np.full(256, 4.0, np.float32)
    cells = {}
    for name, update in (("low", low), ("high", high)):
        counts = np.zeros(16, dtype=np.int64)
        for trial in range(40):
            updates = {f"site-{i:03d}": np.zeros(256, np.float32) for i in range(3)}
            updates["site-000"] = update
            played = play(3, 256, seed=trial, round_no=100 + trial, updates=updates)
            counts += np.bincount(played.server.masked["site-000"].masked >> 28, minlength=16)
        cells[name] = counts
    table = np.stack([cells["low"], cells["high"]]).astype(np.float64)
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    assert float(((table - expected) ** 2 / expected).sum()) < CHI2_15_CRITICAL
    for counts in table:
        uniform = counts.sum() / 16
        assert float(((counts - uniform) ** 2 / uniform).sum()) < CHI2_15_CRITICAL
    assert not np.array_equal(FIXED.encode(low) >> 28, FIXED.encode(high) >> 28)  # the control
