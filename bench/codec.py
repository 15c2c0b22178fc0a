"""Codec throughput against a plain memory copy, on this machine.

For each model size: encode (message -> msgpack bytes), decode (bytes -> validated message, NaN/Inf check
included, tensors as numpy views of the decoded bytes), the chunking work (SHA-256 of every chunk on send, again on
receive, and the copy into the reassembly buffer), and a memcpy of the same number of bytes (numpy copyto into a
buffer already paged in). Decoding copies each tensor's bytes once out of the msgpack buffer (msgpack has no zero-copy
`bin`), then every tensor is a zero-copy view of those bytes: one copy and one finiteness scan in all.

    python bench/codec.py --sizes-mb 4.4 16 32 512 --repeat 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedmqtt.transport.bulk import split
from schemas import messages as m
from schemas.chunks import chunk_digest
from schemas.codec import decode, encode
from schemas.tensors import arrays_to_blobs, blobs_to_arrays, tensors_hash


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def model_of(mb: float) -> m.GlobalModel:
    # A few layers, like a real state_dict: one big weight matrix dominates.
    n = int(mb * 1e6 / 4)
    arrays = {"fc1.weight": np.random.default_rng(0).normal(size=n - 2048).astype(np.float32),
              "fc1.bias": np.zeros(1024, np.float32), "fc2.weight": np.ones(1024, np.float32)}
    blobs = arrays_to_blobs(arrays)
    return m.GlobalModel(run_id="bench", sender="ps", round=1, model=m.ModelSpec(name="mlp"),
                         model_hash=tensors_hash(blobs), tensors=blobs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[4.4, 16, 32, 512])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunk-bytes", type=int, default=2 * 1024 * 1024)
    args = ap.parse_args()
    budget = 1 << 31
    print(f"{'MB':>7} {'memcpy GB/s':>12} {'new-mem GB/s':>12} {'encode GB/s':>12} {'decode GB/s':>12} "
          f"{'enc+dec vs memcpy':>18} {'chunk send GB/s':>16} {'chunk recv GB/s':>16}")
    for mb in args.sizes_mb:
        print(measure(mb, repeat=args.repeat, chunk_bytes=args.chunk_bytes, budget=budget))


def measure(mb: float, *, repeat: int, chunk_bytes: int, budget: int) -> str:
    """One table row: the throughputs for a model of `mb` megabytes."""
    msg = model_of(mb)
    data = encode(msg, max_bytes=budget)
    size = len(data)
    src = np.frombuffer(data, np.uint8)
    dst = np.empty_like(src)
    dst[:] = 1  # touch the pages first: time the copy, not page faults
    t_copy = best(lambda: np.copyto(dst, src), repeat)
    t_fresh = best(lambda: src.copy(), repeat)  # into new memory, page faults included, as a decode pays
    t_enc = best(lambda: encode(msg, max_bytes=budget), repeat)
    t_dec = best(lambda: blobs_to_arrays(decode(data, max_bytes=budget).tensors), repeat)

    def send() -> None:
        _, chunks = split(data, msg, chunk_bytes=chunk_bytes)
        for c in chunks():
            encode(c, max_bytes=budget)

    view = memoryview(data)
    buf = bytearray(size)

    def receive() -> None:  # per chunk: verify and copy into the reassembly buffer (what Fetcher does)
        for start in range(0, size, chunk_bytes):
            piece = view[start:start + chunk_bytes]
            chunk_digest(piece)
            buf[start:start + len(piece)] = piece

    t_send, t_recv = best(send, repeat), best(receive, repeat)
    gb = size / 1e9
    return (f"{size / 1e6:7.1f} {gb / t_copy:12.2f} {gb / t_fresh:12.2f} {gb / t_enc:12.2f} {gb / t_dec:12.2f} "
            f"{(t_enc + t_dec) / t_copy:17.1f}x {gb / t_send:16.2f} {gb / t_recv:16.2f}")

if __name__ == "__main__":
    main()
