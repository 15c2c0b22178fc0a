"""`--track BACKEND[:WHERE]`: which experiment trackers a run writes to, checked before anything trains."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fedmqtt.errors import ConfigError

# backend -> (modules it imports, the extra and the plain package that provide them)
BACKENDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "tensorboard": (("tensorboard.summary.writer.event_file_writer", "tensorboard.plugins.hparams.summary_v2"),
                    "track-tensorboard", "tensorboard"),
    "mlflow": (("mlflow.tracking",), "track-mlflow", "mlflow-skinny"),
}
# MLflow experiment of `fedmqtt simulate` and `fedmqtt ps start` runs (a grid's is the grid's name)
DEFAULT_EXPERIMENT = "fedmqtt"
# rich markup would take "[...]" for a style: "\\[" keeps the bracket in --help
TRACK_HELP = ("Log every round's metrics, the config and the final models to an experiment tracker: "
              "tensorboard\\[:DIR] (default DIR: tensorboard/ in the output folder) or mlflow\\[:URI] (default: "
              "a file store, mlruns/ in the output folder; or a tracking server's URL). Repeat for both. Needs "
              "the extra: pip install 'fedmqtt\\[track-tensorboard]' or 'fedmqtt\\[track-mlflow]' "
              "(docs/tracking.md).")


@dataclass(frozen=True)
class TrackSpec:
    """One `--track` value. `where` is None for the default place (under the run's output folder); a local
    directory or file store is made absolute at parsing, so the spec means the same in a grid's worker."""

    backend: str
    where: str | None = None

    def __str__(self) -> str:
        return self.backend if self.where is None else f"{self.backend}:{self.where}"


def parse_track(value: str) -> TrackSpec:
    """`tensorboard`, `tensorboard:DIR`, `mlflow`, `mlflow:URI` (`mlflow:http://host:5000`, `mlflow:runs/ml`,
    `mlflow:sqlite:///ml.db`); a relative DIR or file-store path is taken from the current folder."""
    backend, sep, where = value.strip().partition(":")
    backend = backend.lower()
    if backend not in BACKENDS:
        raise ConfigError(f"--track {value!r}: unknown tracker {backend!r}; use {' or '.join(BACKENDS)} "
                          "(tensorboard[:DIR], mlflow[:URI])")
    if sep and not where:
        raise ConfigError(f"--track {value!r}: nothing after ':' (leave it out for the default place)")
    if not where:
        return TrackSpec(backend)
    if backend == "tensorboard":
        where = str(Path(where).expanduser().resolve())
    elif is_local_store(where):  # MLflow's file store, by an absolute file: URI
        where = Path(where.removeprefix("file:")).expanduser().resolve().as_uri()
    return TrackSpec(backend, where)


def is_local_store(uri: str) -> bool:
    """A path or file: URI, which MLflow keeps as a file store (rather than sqlite:, http:, databricks...)."""
    scheme = uri.partition(":")[0]
    return uri.startswith("file:") or ":" not in uri or len(scheme) == 1  # a Windows drive letter is a path


def parse_tracks(values: Iterable[str]) -> tuple[TrackSpec, ...]:
    """Every `--track` of a command, parsed and with its package importable: a missing package stops the
    command here, with the pip command to run, before any data is read or any round trains."""
    specs = tuple(parse_track(v) for v in values)
    if len({s.backend for s in specs}) != len(specs):
        raise ConfigError("--track: one of each tracker at most")
    for spec in specs:
        require_backend(spec.backend)
    return specs


def require_backend(backend: str) -> None:
    """Import the backend's modules; ConfigError naming the pip command when the package is missing."""
    modules, extra, package = BACKENDS[backend]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"--track {backend} needs the {package} package, which is not importable here "
                              f"({exc}). Install it with: pip install 'fedmqtt[{extra}]' (or pip install "
                              f"{package})") from None
