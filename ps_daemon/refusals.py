"""The PS's refusal reasons sorted into the few short categories that ps/status counts."""

from __future__ import annotations

# (text a refusal reason contains, the category it is counted under); the first match wins.
REFUSAL_CATEGORIES = (("stale or future round", "wrong round"), ("not selected", "not selected"),
                      ("duplicate", "duplicate"), ("different model version", "wrong model version"),
                      ("was not asked", "not asked"), ("answers session", "wrong session"),
                      ("tensor", "wrong layout"), ("control variates", "wrong layout"),
                      ("layer statistics", "wrong layout"), ("histogram", "bad histogram"),
                      ("a_norm", "out of range"), ("training sample", "out of range"))


def refusal_category(reason: str) -> str:
    """A short, stable counter key for a refusal reason (the log line keeps the whole reason)."""
    return next((label for text, label in REFUSAL_CATEGORIES if text in reason), "refused")
