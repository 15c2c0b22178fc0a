"""How the C heap keeps freed memory: reuse buffers of a model's usual size, return large ones.

Why: every round a site and the PS allocate and free the same buffers again (a model's tensors, chunk slices,
encoded messages, and during training a gradient per parameter per step). glibc's defaults return a freed
block of more than 128 KiB-32 MiB to the system at once and fault it in afresh at the next allocation. With
a 16 MB model, ten sites and five rounds (bench/job_vs_inprocess.py) the tuning below took each site process
from about 550,000 page faults and 1.6 CPU s of kernel time to 200,000 and 0.7 s, and the same work in one
process from 1.8 million faults to 0.6 million.
`tune_heap` lets freed blocks below REUSE_BELOW_BYTES stay in the heap for reuse, keeping at most
KEEP_FREE_BYTES unused at its top; larger blocks (the tensors of a 512 MB model) are still mapped and
unmapped, so they never stay behind.

After a chunked transfer of REUSE_BELOW_BYTES or more, `release_free_heap` hands the heap's free memory
back (`malloc_trim`): such a transfer frees thousands of chunk-sized buffers, and a PS that had just
published a 512 MB model otherwise held some 250 MB more for the rest of the run. Elsewhere than glibc
(macOS, musl) both do nothing.
"""

from __future__ import annotations

import ctypes
import sys

REUSE_BELOW_BYTES = 64 * 2**20  # glibc's M_MMAP_THRESHOLD: smaller blocks come from (and return to) the heap
KEEP_FREE_BYTES = 64 * 2**20  # glibc's M_TRIM_THRESHOLD: free memory kept at the top of the heap
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    if not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt")):  # not glibc
        return None
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc


_LIBC = _glibc()


def tune_heap() -> bool:
    """Set the thresholds above for this process (call it once, early); True where glibc took them."""
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, REUSE_BELOW_BYTES)) and bool(
        _LIBC.mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_BYTES))


def release_free_heap(transfer_bytes: int) -> bool:
    """After a chunked transfer of `transfer_bytes`: return the heap's free memory if it was REUSE_BELOW_BYTES or more.
    True if memory was returned to the system."""
    if _LIBC is None or transfer_bytes < REUSE_BELOW_BYTES:
        return False
    return bool(_LIBC.malloc_trim(0))
