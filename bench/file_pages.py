"""What a model-sized file write costs the writing thread, by what the file was before: new, written over (a
file whose pages are cached, as `write_atomic(..., recycle=...)` uses), or created beforehand by
`posix_fallocate` or `ftruncate` (blocks reserved or a size set, no cached pages). Each write is followed by the
fsync, rename and folder fsync of `write_atomic`'s durable path. CPU seconds of this thread (`time.thread_time`),
the four variants alternating, so load hits them alike; the cost of preparing a file is printed apart (for the
written-over variant it is one new file's write: what `make_spare` pays once per process).

    python bench/file_pages.py --mb 16 --repeats 10 [--folder /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

VARIANTS = ("new", "written over", "fallocate", "ftruncate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--folder", type=Path, default=None, help="where the files go (default: the temp folder)")
    args = parser.parse_args()
    size = int(args.mb * 1e6)
    data = os.urandom(size)
    folder = Path(tempfile.mkdtemp(prefix="fedmqtt-file-pages-", dir=args.folder))

    def prepare(variant: str, name: Path) -> None:
        if variant == "written over":
            with open(name, "wb") as fh:
                fh.write(data)
        elif variant in ("fallocate", "ftruncate"):
            fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)
            (os.posix_fallocate(fd, 0, size) if variant == "fallocate" else os.ftruncate(fd, size))
            os.close(fd)

    def write(variant: str, name: Path, target: Path) -> None:
        with open(name, "wb" if variant == "new" else "r+b") as fh:
            fh.write(data)
            fh.truncate()
            os.fsync(fh.fileno())
        os.replace(name, target)
        fd = os.open(folder, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def timed(call: Callable[..., None], *call_args: object) -> float:
        start = time.thread_time()
        call(*call_args)
        return 1000 * (time.thread_time() - start)

    cost: dict[str, list[float]] = {v: [] for v in VARIANTS}
    prep: dict[str, list[float]] = {v: [] for v in VARIANTS}
    load = [os.getloadavg()[0]]
    try:
        for i in range(args.repeats):
            names = {v: folder / f"{n}-{i}.tmp" for n, v in enumerate(VARIANTS)}
            for v in VARIANTS:
                prep[v].append(timed(prepare, v, names[v]))
            for v in VARIANTS:
                cost[v].append(timed(write, v, names[v], names[v].with_suffix("")))
            load.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(folder)
    print(f"{args.mb:g} MB per file, {args.repeats} rounds of the four variants alternating; load average (1 min) "
          f"{min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs")
    over = statistics.median(cost["written over"])
    for v in VARIANTS:
        med = statistics.median(cost[v])
        print(f"{v:>13}: write + fsync + rename {med:6.1f} ms CPU (x{med / over:.1f} of written over; runs "
              f"{', '.join(f'{c:.1f}' for c in cost[v])}); preparing it {statistics.median(prep[v]):.1f} ms")


if __name__ == "__main__":
    main()
