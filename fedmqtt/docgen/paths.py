"""Where the repository lies, for every generator (a module of its own: generators never import the package)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
