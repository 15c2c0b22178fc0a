"""Where the independent runs of a grid execute: here, one after another, or on a Dask cluster.

An engine maps a module-level function over jobs of plain data (names and keyword arguments that
pickle as dicts, strings and numbers) and yields each job's outcome as it finishes: the function's
return value, or the exception that stopped the job on the engine's side (a worker that died, a
package missing on a worker). The function itself is imported by name on the worker, so a Dask
worker needs the same Python environment and the same paths as the machine that submits.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol

from fedmqtt.errors import ConfigError

Job = tuple[str, dict[str, Any]]  # (name, keyword arguments of plain data)
Outcome = dict[str, Any] | BaseException
# A generator rather than any iterator: the grid closes it when it stops early (Ctrl-C, a failing write),
# which runs the engine's cleanup (the Dask client and local cluster shut down) at once.
Outcomes = Generator[tuple[str, Outcome], None, None]
ENGINES = ("auto", "serial", "dask")
# `auto` (the default): a local cluster of this many worker processes, or one per CPU where there are fewer.
AUTO_WORKERS = 2
log = logging.getLogger(__name__)


class Engine(Protocol):
    name: str
    remote: bool  # jobs may run on other machines (paths must mean the same there)

    def run(self, fn: Callable[..., dict[str, Any]], jobs: Sequence[Job]) -> Outcomes: ...


class SerialEngine:
    """Every job in this process, in order; exceptions propagate (the job function catches its own)."""

    name = "serial"
    remote = False

    def run(self, fn: Callable[..., dict[str, Any]], jobs: Sequence[Job]) -> Outcomes:
        for name, kwargs in jobs:
            yield name, fn(**kwargs)


class DaskEngine:
    """Jobs as Dask tasks: on a LocalCluster of worker processes, or on the scheduler at `address`.

    The local cluster has one thread per worker process, so each run has a process to itself (torch
    and numpy never share an interpreter between runs), and min(workers, jobs) processes; it is
    started for one `run` and shut down after it. With an `address` (tcp://host:8786) the
    cluster is someone else's: it is only connected to, and refused if a worker has more than
    one thread. Tasks are not "pure": a job that was
    submitted twice is run twice, never taken from another client's results.
    """

    name = "dask"

    def __init__(self, address: str | None = None, workers: int | None = None) -> None:
        if address is not None and workers is not None:
            raise ConfigError("--workers sizes the local cluster; a cluster at --cluster has its own workers")
        if workers is not None and workers < 1:
            raise ConfigError(f"--workers must be at least 1 (got {workers})")
        self.address = address
        self.workers = workers
        self.remote = address is not None

    def run(self, fn: Callable[..., dict[str, Any]], jobs: Sequence[Job]) -> Outcomes:
        if not jobs:
            return
        distributed = _import_distributed()
        cluster = None
        if self.address is None:
            n = min(self.workers or os.cpu_count() or 1, len(jobs))
            # processes=True: a run per process; silence_logs: the cluster's own chatter stays out of the
            # terminal unless it is an error; its HTTP server on a free port, so two grids never collide.
            cluster = distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                               dashboard_address=":0", silence_logs=logging.ERROR)
        try:
            client = distributed.Client(cluster if cluster is not None else self.address)
        except OSError as exc:
            if cluster is not None:
                cluster.close()
            raise ConfigError(f"cannot reach the Dask scheduler at {self.address}: {exc}") from None
        try:
            _check_workers(client, self.address)
            batch = uuid.uuid4().hex[:8]  # task keys unique per submission, readable in the scheduler
            futures = {client.submit(fn, **kwargs, key=f"fedmqtt-grid-{name}-{batch}", pure=False): name
                       for name, kwargs in jobs}
            for future in distributed.as_completed(futures):
                try:
                    outcome: Outcome = future.result()
                except Exception as exc:  # noqa: BLE001 - the worker's failure is this job's outcome
                    outcome = exc
                yield futures[future], outcome
        finally:
            client.close()
            if cluster is not None:
                cluster.close()


def _check_workers(client: Any, address: str | None) -> None:
    """Refuse workers that would run two points in one process: torch's global generator and thread
    count are per process, so two runs side by side there would not give the serial grid's bits."""
    threads = client.nthreads()
    if crowded := sorted(w for w, n in threads.items() if n > 1):
        raise ConfigError(f"Dask workers with more than one thread ({', '.join(crowded)}): two grid points in "
                          "one process would share torch's random generator; start them with "
                          "`dask worker ADDRESS --nthreads 1 --nworkers N` (docs/grids.md)")
    if not threads:
        log.warning("no Dask worker at %s yet: the runs wait until one joins", address)


def make_engine(name: str, *, address: str | None = None, workers: int | None = None,
                points: int | None = None) -> Engine:
    """The engine `fedmqtt grid --engine NAME [--cluster ADDRESS] [--workers N]` asks for; `points`: how many
    runs it will get (`auto` runs a single one here, without starting a cluster)."""
    if name == "auto":
        return _auto_engine(address, workers, points)
    if name == "serial":
        if address is not None or workers is not None:
            raise ConfigError("--cluster and --workers go with --engine dask")
        return SerialEngine()
    if name == "dask":
        return DaskEngine(address, workers)
    raise ConfigError(f"unknown engine {name!r}; available: {', '.join(ENGINES)}")


def _auto_engine(address: str | None, workers: int | None, points: int | None) -> Engine:
    """Both cores by default: the runs are independent and each has a worker process to itself, so a local
    cluster gives the serial grid's bits (docs/grids.md). Serial where a cluster gains nothing (one run, one
    CPU, or `--workers 1`) and where Dask is not installed."""
    if address is not None:
        return DaskEngine(address, workers)
    n = workers if workers is not None else min(AUTO_WORKERS, os.cpu_count() or 1)
    if n < 1:
        raise ConfigError(f"--workers must be at least 1 (got {n})")
    if n == 1 or (points is not None and points < 2):
        return SerialEngine()
    try:
        _import_distributed()
    except ConfigError:
        log.info("Dask is not installed: the grid runs serially (pip install 'fedmqtt[cluster]' for %d workers)", n)
        return SerialEngine()
    return DaskEngine(None, n)


def _import_distributed() -> Any:
    try:
        import dask.distributed
    except ImportError:
        raise ConfigError("--engine dask needs Dask: pip install 'fedmqtt[cluster]' "
                          "(the same on every worker)") from None
    return dask.distributed
