"""Experiment tracking (`--track tensorboard[:DIR]`, `--track mlflow[:URI]`; docs/tracking.md).

`parse_tracks` checks the options and that the packages are installed (at start-up, with the pip command);
`open_tracker` opens a run's trackers; the PS calls `RunTracker.round_closed` as each round closes and the
caller `run_finished` once the report is written. The backends are optional extras, imported only here.
"""

from __future__ import annotations

from fedmqtt.tracking.run import RunTracker, open_tracker, tracked_run
from fedmqtt.tracking.spec import TRACK_HELP, TrackSpec, parse_track, parse_tracks

__all__ = ["TRACK_HELP", "RunTracker", "TrackSpec", "open_tracker", "parse_track", "parse_tracks", "tracked_run"]
