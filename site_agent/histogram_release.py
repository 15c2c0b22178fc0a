"""The label histogram this site shares (recruitment, FedDkw), under its policy's `label_histogram_epsilon`:
released once with Gaussian noise (fedmqtt/training/histogram_dp.py), charged to the privacy ledger before it
leaves, and kept in the state folder, so that every later status and update re-sends the same noised counts
(post-processing: free) instead of drawing, and spending, again. A new release (and a new charge) happens only when
the policy's epsilon or delta, or the exact counts, change.

The kept file is read as hostile input (size, then a strict schema); a damaged one is replaced by a new release,
which the ledger charges again: over-counting, never under-counting.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedmqtt.atomic import private_dir, write_atomic
from fedmqtt.training.histogram_dp import noise_multiplier, noised_histogram, sensitivity
from schemas.messages import LabelHistogram, PrivacyPolicy
from site_agent.privacy_ledger import PrivacyLedger

log = logging.getLogger(__name__)

RELEASE_FILE = "label_histogram.json"
MAX_RELEASE_BYTES = 4 * 1024 * 1024
DEFAULT_DELTA = 1e-5


class Release(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    version: Annotated[int, Field(ge=1, le=1)] = 1
    epsilon: Annotated[float, Field(gt=0, le=100)]
    delta: Annotated[float, Field(gt=0, lt=1)]
    noise_multiplier: Annotated[float, Field(gt=0, le=1e6)]
    source: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]  # SHA-256 of the exact counts it was drawn from
    histogram: LabelHistogram


def _digest(counts: dict[str, int]) -> str:
    return hashlib.sha256(json.dumps(counts, sort_keys=True).encode()).hexdigest()


class HistogramRelease:
    """This site's shared label histogram, kept in `folder` (the ledger's)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / RELEASE_FILE

    def shared(self, exact: dict[str, int], policy: PrivacyPolicy, task_kind: str,
               ledger: PrivacyLedger) -> dict[str, int] | None:
        """What leaves the site: the exact counts without a policy epsilon, else the kept noised release (a new
        one, charged to `ledger`, when none fits); None when the budget or a damaged ledger forbids a release."""
        eps = policy.label_histogram_epsilon
        if eps is None:
            return exact
        delta = policy.max_delta or DEFAULT_DELTA
        kept = self._load()
        if kept is not None and (kept.epsilon, kept.delta, kept.source) == (eps, delta, _digest(exact)):
            return dict(kept.histogram)
        try:
            z = noise_multiplier(eps, delta)
            history = ledger.history()
        except ValueError as exc:  # LedgerError too: a damaged ledger, or an epsilon no accountant reaches
            log.warning("label histogram not shared: %s", exc)
            return None
        after = [*history, (z, 1.0, 1)]
        if policy.max_epsilon is not None:
            from fedmqtt.training.privacy import epsilon  # torch: only a site that releases needs it

            spent = epsilon(after, delta, "rdp")
            if spent > policy.max_epsilon:
                log.warning("label histogram not shared: its release would bring epsilon to %.3g at delta %g, "
                            "above this site's max_epsilon %g", spent, delta, policy.max_epsilon)
                return None
        ledger.save(after)  # charged before a count leaves the site
        noised = noised_histogram(exact, z * sensitivity(task_kind, len(exact)), np.random.default_rng())
        release = Release(epsilon=eps, delta=delta, noise_multiplier=z, source=_digest(exact), histogram=noised)
        private_dir(self.folder)
        write_atomic(self.path, json.dumps(release.model_dump(mode="json")).encode())
        log.info("label histogram released with Gaussian noise (multiplier %.3g) at epsilon %g, delta %g; charged "
                 "to the privacy ledger", z, eps, delta)
        return noised

    def _load(self) -> Release | None:
        if not self.path.exists():
            return None
        try:
            if self.path.stat().st_size > MAX_RELEASE_BYTES:
                raise ValueError("too large")
            return Release.model_validate(json.loads(self.path.read_bytes()))
        except (ValueError, ValidationError, RecursionError, OSError) as exc:
            log.warning("the kept label histogram release %s is damaged (%s): releasing anew (charged again)",
                        self.path, " ".join(str(exc).split())[:200])
            return None
