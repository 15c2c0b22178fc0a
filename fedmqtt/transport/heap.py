"""Hand the C heap's free memory back to the operating system after a chunked transfer.

Why: a transfer of a large model allocates and frees thousands of chunk-sized buffers (payload slices,
chunk messages, paho's packets). glibc keeps freed memory of that size in its heap for reuse, so a PS
that had just published a 512 MB model held some 250 MB more for the rest of the run, and every later
peak stood on top of it. `malloc_trim(0)` returns it; it costs a few milliseconds, once per transfer.
Elsewhere than glibc (macOS, musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release_free_heap() -> bool:
    """True if memory was returned to the system."""
    return bool(_TRIM(0)) if _TRIM is not None else False
