"""The PS counts each refusal under a short, stable category (ps/status `rejected`), found in its reason."""

from __future__ import annotations

import pytest

from ps_daemon.refusals import REFUSAL_CATEGORIES, refusal_category


@pytest.mark.parametrize("reason,category", [
    ("stale or future round (PS is in training round 3)", "wrong round"),
    ("answers session 'abc', not this start of the run (def)", "wrong session"),
    ("control variates sent, but the run's algorithm 'fedavg' takes none", "wrong layout"),
    ("scalar a_norm 7.2 is outside (0.0, 1.0)", "out of range"),
    ("an update needs at least one training sample and one local step (got 0, 1)", "out of range"),
    ("duplicate report (the first one was taken)", "duplicate"),
    ("a reason no category mentions", "refused"),
])
def test_a_reason_is_counted_under_its_category(reason: str, category: str) -> None:
    assert refusal_category(reason) == category


def test_the_first_matching_text_wins() -> None:
    """Order matters: a reason naming both a stale round and a tensor is a wrong round, not a wrong layout."""
    texts = [text for text, _ in REFUSAL_CATEGORIES]
    assert texts.index("stale or future round") < texts.index("tensor")
    assert refusal_category("stale or future round; tensor 'w' has another shape") == "wrong round"
