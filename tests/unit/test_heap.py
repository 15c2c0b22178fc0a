"""The C heap reuses model-sized buffers once tuned, and hands free memory back only after large transfers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fedmqtt.transport import heap

pytestmark = pytest.mark.skipif(heap._LIBC is None, reason="glibc only (the tuning does nothing elsewhere)")

_CHURN = """
import json, resource, sys
import numpy as np
from fedmqtt.transport.heap import tune_heap
if sys.argv[1] == "tuned":
    assert tune_heap()
def round_of_work():  # 16 MB buffers and 1 MiB chunks held at once, less than KEEP_FREE_BYTES in all
    held = [np.ones(4 << 20, np.float32) for _ in range(2)] + [np.ones(1 << 18, np.float32) for _ in range(16)]
    del held
round_of_work()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    round_of_work()
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_a_tuned_process_reuses_a_rounds_buffers_instead_of_faulting_them_in_again() -> None:
    untuned, tuned = _faults("default"), _faults("tuned")
    assert untuned > 10 * 3000  # glibc's defaults give much of it back each round (here ~4,600 pages a round)
    assert tuned < 2000, (tuned, untuned)


def test_free_memory_goes_back_only_after_a_transfer_larger_than_what_the_heap_reuses() -> None:
    assert heap.release_free_heap(16 * 2**20) is False
    assert heap.release_free_heap(heap.REUSE_BELOW_BYTES - 1) is False
    heap.release_free_heap(heap.REUSE_BELOW_BYTES)  # trims (returns whether anything was freed)
