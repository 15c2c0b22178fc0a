"""A run's trackers behind one object that never stops or slows the run.

Opening a tracker (its folder, its MLflow experiment and run) happens at start-up and fails loudly there.
After that every call is queued and done by one background thread: a tracking server that is slow or gone
costs the federation nothing, and a failure is logged (the first of each backend as a warning) and the run
goes on. `close` waits a bounded time for the queue to drain.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from fedmqtt.errors import ConfigError
from fedmqtt.tracking.scalars import (
    ParamValue,
    final_scalars,
    final_step,
    flat_params,
    report_round_scalars,
    round_scalars,
)
from fedmqtt.tracking.spec import TrackSpec
from schemas.messages import RoundMetrics

log = logging.getLogger("fedmqtt.tracking")
CLOSE_WAIT_S = 60.0  # at the end, how long the run waits for the trackers to take what is queued
# The run's outputs a tracker gets at the end, where they exist (the models by their report's `models`).
REPORT_FILES = ("report.json", "report.md", "per_site.csv")


class Backend(Protocol):
    name: str

    def log_config(self, params: Mapping[str, ParamValue], config: Mapping[str, Any]) -> None: ...

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def log_final(self, step: int, scalars: Mapping[str, float], files: Sequence[Path]) -> None: ...

    def logged_rounds(self) -> set[int]: ...

    def close(self, status: str) -> None: ...


class RunTracker:
    """What a run reports as it goes: `round_closed` per round, `run_finished` with the report, `close`."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        self.backends = tuple(backends)
        self.failures: dict[str, int] = {}
        # Per backend, the rounds it has: those an earlier start logged (a resumed run), then those sent here.
        self._rounds: dict[str, set[int]] = {b.name: set() for b in self.backends}
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="fedmqtt-tracking", daemon=True)
        self._closed = False
        self.reported = False  # run_finished was called
        if self.backends:
            self._thread.start()

    def log_config(self, config: Mapping[str, Any]) -> None:
        params = flat_params(config)
        self._each("log the config", lambda b: b.log_config(params, config))

    def round_closed(self, metrics: RoundMetrics) -> None:
        """Called by the PS as it publishes a round's metrics (ps/metrics)."""
        scalars = round_scalars(metrics)
        for rounds in self._rounds.values():
            rounds.add(metrics.round)
        self._each(f"log round {metrics.round}", _scalars_at(metrics.round, scalars))

    def resumed(self) -> None:
        """The run continues an earlier start: learn the rounds each tracker has (at start-up, before any
        round), so that `run_finished` logs only those it misses."""
        for backend in self.backends:
            try:
                self._rounds[backend.name] |= backend.logged_rounds()
            except Exception as exc:  # noqa: BLE001 - then the missed rounds are logged again
                log.warning("tracking (%s): cannot read the rounds logged before: %s", backend.name, exc)

    def run_finished(self, report: Mapping[str, Any], out_dir: Path) -> None:
        """The final report (as written to out_dir/report.json): final metrics, models and report files; and
        from the report, the rounds a tracker does not have (a PS killed before it logged them, then resumed)."""
        self.reported = True
        for backend in self.backends:
            for entry in report.get("rounds", []):
                if entry["round"] not in self._rounds[backend.name]:
                    self._one(backend, f"log round {entry['round']}",
                              _scalars_at(entry["round"], report_round_scalars(entry)))
        scalars, step = final_scalars(report), final_step(report)
        models = [Path(p) for p in report.get("models", {}).values()]
        files = [p for p in (*models, *(out_dir / name for name in REPORT_FILES)) if p.is_file()]
        self._each("log the final report", lambda b: b.log_final(step, scalars, files))

    def close(self, status: str | None = None) -> None:
        """End the tracked runs and wait (a bounded time) for the queue. `status` (MLflow's run states):
        default FINISHED once `run_finished` was called, else KILLED (the run stopped before its end)."""
        if self._closed or not self.backends:
            return
        status = status or ("FINISHED" if self.reported else "KILLED")
        self._each("close", lambda b: b.close(status))
        self._closed = True
        self._queue.put(None)
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning("tracking: still busy after %.0f s; the rest of what was queued is not logged",
                        CLOSE_WAIT_S)
        for name, n in self.failures.items():
            log.warning("tracking (%s): %d call(s) failed, the first said above (the others at debug level)", name, n)

    def _each(self, what: str, call: Callable[[Backend], None]) -> None:
        for backend in self.backends:
            self._one(backend, what, call)

    def _one(self, backend: Backend, what: str, call: Callable[[Backend], None]) -> None:
        if not self._closed:
            self._queue.put(functools.partial(self._guarded, backend, what, call))

    def _guarded(self, backend: Backend, what: str, call: Callable[[Backend], None]) -> None:
        try:
            call(backend)
        except Exception as exc:  # noqa: BLE001 - a tracker's failure must never stop the federation
            n = self.failures.get(backend.name, 0) + 1
            self.failures[backend.name] = n
            (log.warning if n == 1 else log.debug)("tracking (%s): could not %s: %s: %s; the run goes on",
                                                   backend.name, what, type(exc).__name__, exc)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            job()


def _scalars_at(step: int, scalars: Mapping[str, float]) -> Callable[[Backend], None]:
    return lambda backend: backend.log_scalars(step, scalars)


@contextmanager
def tracked_run(specs: Sequence[TrackSpec], **kwargs: Any) -> Iterator[RunTracker | None]:
    """`open_tracker` for the `with` block (None without specs), closed at its end: FINISHED where the block
    reported the run's end, KILLED where it stopped before (a signal), FAILED where it raised."""
    if not specs:
        yield None
        return
    tracker = open_tracker(specs, **kwargs)
    try:
        yield tracker
    except BaseException as exc:
        tracker.close("FAILED" if isinstance(exc, Exception) else "KILLED")
        raise
    tracker.close()


def open_tracker(specs: Sequence[TrackSpec], *, root: Path, run_name: str, experiment: str,
                 config: Mapping[str, Any], tags: Mapping[str, str] | None = None,
                 fresh: bool = True, resume: bool = False) -> RunTracker:
    """Open every tracker of `specs` for one run and queue its config. Default places are under `root` (the
    run's output folder, or a grid's): TensorBoard writes root/tensorboard/<run_name>/, MLflow a file store
    root/mlruns with the run in `experiment`; an explicit TensorBoard DIR gets a folder per run as well.
    `fresh`: the run starts over, so its folder's event files of an earlier run of the same name go (else
    they are appended to); MLflow keeps every run, and `resume` continues the newest unfinished one of that
    name. Opening fails with ConfigError, before any round."""
    backends: list[Backend] = []
    for spec in specs:
        try:
            backends.append(_open_backend(spec, root=root, run_name=run_name, experiment=experiment,
                                          tags=dict(tags or {}), fresh=fresh, resume=resume))
        except Exception as exc:
            for opened in backends:  # no half-open set: a tracker that opened is closed again
                opened.close("FAILED")
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"--track {spec}: cannot open the tracker: {type(exc).__name__}: {exc}") from None
    tracker = RunTracker(backends)
    if resume:
        tracker.resumed()
    tracker.log_config(config)
    return tracker


def _open_backend(spec: TrackSpec, *, root: Path, run_name: str, experiment: str, tags: dict[str, str],
                  fresh: bool, resume: bool) -> Backend:
    if spec.backend == "tensorboard":
        from fedmqtt.tracking.tensorboard_backend import TensorBoardBackend

        logdir = Path(spec.where) if spec.where is not None else root / "tensorboard"
        return TensorBoardBackend(logdir.resolve() / run_name, fresh=fresh)
    from fedmqtt.tracking.mlflow_backend import MlflowBackend

    uri = spec.where if spec.where is not None else (root / "mlruns").resolve().as_uri()
    return MlflowBackend(uri, experiment=experiment, run_name=run_name, tags=tags, resume=resume)
