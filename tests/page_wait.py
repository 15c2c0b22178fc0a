"""Browser tests: wait until a page script's answer satisfies a predicate, or fail with the last answer seen."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any


def wait_for(driver: Any, script: str, predicate: Callable[[Any], bool], what: str, timeout_s: float = 30) -> Any:
    """Run `script` in the page every 0.2 s until `predicate` holds for its (truthy) answer; return that answer."""
    end, page = time.monotonic() + timeout_s, None
    while time.monotonic() < end:
        page = driver.execute_script(script)
        if page and predicate(page):
            return page
        time.sleep(0.2)
    raise AssertionError(f"page never showed {what}; last seen: {json.dumps(page)[:3000]}")
