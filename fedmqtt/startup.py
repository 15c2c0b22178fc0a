"""A process's imports without the cycle collector's passes over them.

Importing torch and the package makes some 300,000 objects, nearly all of them for the life of the process.
With the collector on, each full pass during the imports walks all of those made so far: about 0.25 of a site
process's 1.5 CPU s of imports went to passes that found next to nothing (issue 30, goal 3). Inside
`imports_without_gc` the collector is off; reference counting still frees everything that is not in a cycle,
and what cycles were made are collected by the first pass after the section. `keep_what_is_loaded` then moves
everything alive out of later passes (`gc.freeze`), as pre-fork servers do: called once a process has loaded
what it keeps and before it does its work, so nothing of that work is frozen.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_open = 0  # sections open now that found the collector on (or nested in one that did)


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """The collector off while the body imports; on again when the last open section ends.

    Safe to nest and to enter from several threads (the site imports torch on a worker thread while its main
    thread may import too). A collector that someone else turned off stays off."""
    global _open
    with _lock:
        ours = _open > 0 or gc.isenabled()
        if ours:
            _open += 1
            gc.disable()
    try:
        yield
    finally:
        if ours:
            with _lock:
                _open -= 1
                if _open == 0:
                    gc.enable()


def keep_what_is_loaded() -> None:
    """Move every object alive now out of the collector's later passes (`gc.freeze`): the modules and classes
    a process keeps until it exits. Call it in a process's own start-up path only (never from library code,
    where the caller's objects would be frozen too), after its imports and before its work. Cycles that the
    imports left unreachable stay allocated (a few thousand small objects); cycles made later are collected as
    before."""
    gc.freeze()


__all__ = ["imports_without_gc", "keep_what_is_loaded"]
