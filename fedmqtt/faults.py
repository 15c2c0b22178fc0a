"""Fault injection for the fault-tolerance tests: a real SIGKILL at a named point of a real process.

`FEDMQTT_FAULT=<point>:<round>` (e.g. `after_checkpoint:1`, `site_before_publish:2`) kills the
process right there, so tests can crash the PS or a site at the worst moment deterministically.
Unset in production: the check is one environment lookup.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)


def crash_point(where: str, round_no: int) -> None:
    if os.environ.get("FEDMQTT_FAULT") == f"{where}:{round_no}":
        log.warning("fault injection: SIGKILL at %s of round %d", where, round_no)
        os.kill(os.getpid(), signal.SIGKILL)
