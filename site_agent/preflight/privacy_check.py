"""The site's privacy policy and its privacy ledger: what the site will refuse, what its records have spent, and
whether it can train with record-level DP at all (opacus installed, the ledger readable)."""

from __future__ import annotations

import importlib.util

from site_agent.config import SiteConfig
from site_agent.policy import PrivacyPolicy
from site_agent.preflight.findings import Finding, failed, passed
from site_agent.privacy_ledger import LedgerError, PrivacyLedger

PRIVACY = "privacy"
REPORT_DELTA = 1e-5  # the delta the check reports epsilon at when the policy names none


def check_privacy(config: SiteConfig) -> Finding:
    policy, ledger = config.privacy, PrivacyLedger(config.state_dir / "privacy")
    rules = policy_summary(policy)
    try:
        history = ledger.history()
    except LedgerError as exc:
        return failed(PRIVACY, str(exc).split(";")[0], "Restore accountant.json from this site's backup; until then "
                      "the site refuses every task with record-level DP.", ledger=str(ledger.path))
    needs_dp = policy.require_record_dp or policy.max_epsilon is not None
    if (needs_dp or history) and importlib.util.find_spec("opacus") is None:
        return failed(PRIVACY, f"policy: {rules}; but opacus is not installed, so this site cannot train with "
                      "record-level DP or account for it", "Install the privacy extra: "
                      "`pip install 'fedmqtt[privacy]'` (docs/privacy.md).", policy=rules)
    steps = sum(n for _, _, n in history)
    if not history:
        return passed(PRIVACY, f"policy: {rules}; no record-level DP spent yet", policy=rules, steps=0)
    from fedmqtt.training.privacy import epsilon

    delta = policy.max_delta or REPORT_DELTA
    spent = epsilon(history, delta)
    budget = f" of max_epsilon {policy.max_epsilon:g}" if policy.max_epsilon is not None else ""
    return passed(PRIVACY, f"policy: {rules}; ledger: {steps} DP-SGD steps, epsilon {spent:.3g}{budget} at delta "
                  f"{delta:g} (RDP)", policy=rules, steps=steps, epsilon=spent, delta=delta)


def policy_summary(policy: PrivacyPolicy) -> str:
    """The rules that are set, in one line ("none" when the site trains whatever the run asks). A setting left at
    its default is not a rule (the histogram's mechanism matters only once label_histogram_epsilon is set)."""
    defaults = type(policy)()
    parts = [f"{name} {value:g}" if isinstance(value, float) else
             f"{name} {', '.join(value)}" if isinstance(value, tuple) else
             name if value is True else f"{name} {value}"
             for name, value in policy.model_dump().items()
             if value not in (None, False, 0) and value != getattr(defaults, name)]
    return ", ".join(parts) or "none (trains whatever the run asks)"
