"""The label histogram this site shares (recruitment, FedDkw), under its policy's `label_histogram_epsilon`:
released once with Gaussian or Laplace noise (`label_histogram_noise`; fedmqtt/training/histogram_dp.py), charged
to the privacy ledger before it leaves (a Gaussian step, or a pure-epsilon entry for Laplace), and kept in the
state folder, so that every later status and update re-sends the same noised counts (post-processing: free)
instead of drawing, and spending, again. A new release (and a new charge) happens only when the policy's mechanism,
epsilon or delta, or the exact counts, change.

The kept file is read as hostile input (size, then a strict schema); a damaged one is replaced by a new release,
which the ledger charges again: over-counting, never under-counting.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedmqtt.atomic import private_dir, write_atomic
from fedmqtt.training.histogram_dp import (
    l1_sensitivity,
    laplace_scale,
    noise_multiplier,
    noised_histogram,
    sensitivity,
)
from schemas.messages import LabelHistogram, PrivacyPolicy
from site_agent.privacy_ledger import PrivacyLedger

log = logging.getLogger(__name__)

RELEASE_FILE = "label_histogram.json"
MAX_RELEASE_BYTES = 4 * 1024 * 1024
DEFAULT_DELTA = 1e-5


class Release(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    version: Annotated[int, Field(ge=1, le=1)] = 1
    mechanism: Literal["gaussian", "laplace"] = "gaussian"
    epsilon: Annotated[float, Field(gt=0, le=100)]
    delta: Annotated[float, Field(gt=0, lt=1)]  # Laplace: the policy's delta (unused; a change still re-releases)
    # the noise's std (Gaussian) or scale (Laplace) per unit of sensitivity
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
        mechanism = policy.label_histogram_noise
        kept = self._load()
        if kept is not None and (kept.mechanism, kept.epsilon, kept.delta, kept.source) == (
                mechanism, eps, delta, _digest(exact)):
            return dict(kept.histogram)
        try:
            laplace = mechanism == "laplace"
            z = laplace_scale(eps, task_kind, len(exact)) if laplace else noise_multiplier(eps, delta)
            history, pure = ledger.history(), ledger.pure_epsilon()
        except ValueError as exc:  # LedgerError too: a damaged ledger, or an epsilon no accountant reaches
            log.warning("label histogram not shared: %s", exc)
            return None
        after = history if laplace else [*history, (z, 1.0, 1)]
        if policy.max_epsilon is not None:
            from fedmqtt.training.privacy import epsilon  # torch: only a site that releases needs it

            # basic composition with the pure releases (site_agent/privacy_ledger.py)
            spent = epsilon(after, delta, "rdp") + pure + (eps if laplace else 0.0)
            if spent > policy.max_epsilon:
                log.warning("label histogram not shared: its release would bring epsilon to %.3g at delta %g, "
                            "above this site's max_epsilon %g", spent, delta, policy.max_epsilon)
                return None
        if laplace:  # charged before a count leaves the site; z is the scale b itself
            ledger.charge_pure(eps)
            std, per_unit = z, z / l1_sensitivity(task_kind, len(exact))
        else:
            ledger.save(after)
            std, per_unit = z * sensitivity(task_kind, len(exact)), z
        noised = noised_histogram(exact, std, np.random.default_rng(), mechanism)
        release = Release(mechanism=mechanism, epsilon=eps, delta=delta, noise_multiplier=per_unit,
                          source=_digest(exact), histogram=noised)
        private_dir(self.folder)
        write_atomic(self.path, json.dumps(release.model_dump(mode="json")).encode())
        log.info("label histogram released with %s noise (std or scale %.3g per unit of sensitivity) at epsilon "
                 "%g%s; charged to the privacy ledger", mechanism.capitalize(), per_unit, eps,
                 "" if laplace else f", delta {delta:g}")
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
