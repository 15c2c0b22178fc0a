"""The site's privacy ledger: the accountant's history of every DP-SGD round its records ever served, and the
pure-epsilon releases (the Laplace label histogram) beside it.

Two kinds of entry. Gaussian steps (noise multiplier, sample rate, steps), which Opacus' RDP or PRV accountant
composes into epsilon at the task's delta; and pure epsilon-DP releases, which no accountant of Opacus models.
They compose by basic sequential composition (Dwork and Roth, The algorithmic foundations of differential privacy,
Theorem 3.16): an (eps_G, delta)-DP history followed by releases of pure eps_1, ..., eps_k is
(eps_G + eps_1 + ... + eps_k, delta)-DP, whichever accountant gave eps_G. That is conservative (an RDP accountant
could charge an eps-DP release min(eps, alpha eps^2 / 2) at each order alpha instead, Bun and Steinke), never
under-counting: `total_epsilon` is what every epsilon the site reports or judges is.

Kept in the state folder (never cleared when the PS starts a new run: the records are the same), written
atomically before the update it covers leaves the site, and read as hostile input: a file another process or an
old version wrote is checked for size, schema and ranges before a single entry is used. A damaged or missing-
but-expected ledger is never taken as "nothing spent" (that would under-count): DP training stops with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedmqtt.atomic import private_dir, write_atomic

MAX_LEDGER_BYTES = 4 * 1024 * 1024
MAX_ENTRIES = 50_000  # Opacus merges equal consecutive entries: one per change of noise or sampling rate
Entry = tuple[Annotated[float, Field(ge=0, le=1e4, allow_inf_nan=False)],  # noise multiplier
              Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)],  # sample rate
              Annotated[int, Field(ge=1, le=10**12)]]  # steps


class LedgerError(ValueError):
    """The ledger cannot be trusted; the message says what is wrong and what to do."""


PureEpsilon = Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)]


class LedgerFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    version: Annotated[int, Field(ge=1, le=1)] = 1
    history: Annotated[tuple[Entry, ...], Field(max_length=MAX_ENTRIES)] = ()
    # pure epsilon-DP releases (a Laplace label histogram), composed with the history by adding (module text)
    pure: Annotated[tuple[PureEpsilon, ...], Field(max_length=MAX_ENTRIES)] = ()


class PrivacyLedger:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / "accountant.json"

    def history(self) -> list[tuple[float, float, int]]:
        """The stored Gaussian history ([] before the first DP round).

        Raises:
            LedgerError: the file is too large, not JSON, or not a valid history.
        """
        return [(float(s), float(q), int(n)) for s, q, n in self._load().history]

    def pure_epsilon(self) -> float:
        """The pure epsilon of every pure-DP release so far, added up (0 for none). LedgerError: as `history`."""
        return float(sum(self._load().pure))

    def save(self, history: Sequence[tuple[float, float, int]]) -> None:
        """Store `history` as the Gaussian part; the pure releases stay as they are."""
        self._write(LedgerFile(history=tuple((float(s), float(q), int(n)) for s, q, n in history),
                               pure=self._load().pure))

    def charge_pure(self, epsilon: float) -> None:
        """Record one pure epsilon-DP release (before what it covers leaves the site)."""
        ledger = self._load()
        self._write(LedgerFile(history=ledger.history, pure=(*ledger.pure, float(epsilon))))

    def _write(self, ledger: LedgerFile) -> None:
        private_dir(self.folder)
        write_atomic(self.path, json.dumps(ledger.model_dump(mode="json")).encode())

    def _load(self) -> LedgerFile:
        if not self.path.exists():
            return LedgerFile()
        size = self.path.stat().st_size
        if size > MAX_LEDGER_BYTES:
            raise LedgerError(self._damaged(f"{size} bytes, more than {MAX_LEDGER_BYTES}"))
        try:
            raw = json.loads(self.path.read_bytes())
            # JSON has lists, not tuples: convert the outer shape only, strict mode checks every number's type.
            if isinstance(raw, dict) and isinstance(raw.get("history"), list):
                raw["history"] = tuple(tuple(e) if isinstance(e, list) else e for e in raw["history"])
            if isinstance(raw, dict) and isinstance(raw.get("pure"), list):
                raw["pure"] = tuple(raw["pure"])
            return LedgerFile.model_validate(raw)
        except (ValueError, ValidationError, RecursionError) as exc:
            raise LedgerError(self._damaged(" ".join(str(exc).split())[:240])) from None

    def _damaged(self, why: str) -> str:
        return (f"the privacy ledger {self.path} is damaged ({why}); this site trains with record-level DP again "
                "only once it is restored from a backup (starting from nothing would under-count what was spent)")
