"""The PS's own refusal reasons, each counted in ps/status under a short, stable category."""

# (text the reason contains, category): the first match wins; a reason that matches none is "refused".
REFUSAL_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("stale or future round", "wrong round"), ("not selected", "not selected"),
    ("duplicate", "duplicate"), ("different model version", "wrong model version"),
    ("was not asked", "not asked"), ("answers session", "wrong session"),
    ("tensor", "wrong layout"), ("control variates", "wrong layout"), ("layer statistics", "wrong layout"),
    ("histogram", "bad histogram"), ("a_norm", "out of range"), ("training sample", "out of range"),
    ("record-level DP", "privacy"), ("epsilon at delta", "privacy"), ("label set", "label set"),
    ("val split", "wrong layout"))

# a site's feature summary that cannot join the federation's statistics (ps_daemon/feature_gate.py says why)
FEATURE_SUMMARY_REFUSED = "feature summary refused"


def refusal_category(reason: str) -> str:
    """A short, stable counter key for a refusal reason (the log line keeps the whole reason)."""
    return next((label for text, label in REFUSAL_CATEGORIES if text in reason), "refused")
