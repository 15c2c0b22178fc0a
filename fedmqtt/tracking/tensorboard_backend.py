"""TensorBoard: event files a `tensorboard --logdir DIR` shows, written with the tensorboard package alone.

Scalars are written as `simple_value` summaries (as torch's SummaryWriter writes them), the config as a
text summary and the flattened config as the hparams plugin's session start, so runs of a grid can be
compared in TensorBoard's HParams tab. The final models and reports are not copied: TensorBoard shows no
files; the config text names where they are.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedmqtt.tracking.scalars import ROUND_MARK, ParamValue

EVENT_FILE_PREFIX = "events.out.tfevents."  # what EventFileWriter names its files
EVENT_FLUSH_S = 10  # the writer's own thread flushes this often; close() flushes the rest


class TensorBoardBackend:
    """One run's event files in `logdir` (a folder per run, so one `--logdir` above them compares runs).
    `fresh`: remove the event files an earlier run of the same name left there (else TensorBoard draws both
    runs as one, going back and forth); a resumed PS appends instead."""

    name = "tensorboard"

    def __init__(self, logdir: Path, *, fresh: bool = True) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        if fresh:
            for old in logdir.glob(f"{EVENT_FILE_PREFIX}*"):
                old.unlink()
        self._earlier_rounds: set[int] = set() if fresh else self._rounds_in(logdir)
        self.logdir = logdir
        self._writer = EventFileWriter(str(logdir), flush_secs=EVENT_FLUSH_S)

    def log_config(self, params: Mapping[str, ParamValue], config: Mapping[str, Any]) -> None:
        from tensorboard.plugins.hparams.summary_v2 import hparams_pb

        text = "```json\n" + json.dumps(config, indent=2, default=str) + "\n```"
        self._add(0, self._text_summary("config", text))
        self._add(0, hparams_pb(dict(params)))

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(step, Summary(value=[Summary.Value(tag=tag, simple_value=value)
                                       for tag, value in sorted(scalars.items())]))

    def log_final(self, step: int, scalars: Mapping[str, float], files: Sequence[Path]) -> None:
        self.log_scalars(step, scalars)
        listing = "\n".join(f"- `{f}`" for f in files) or "(none)"
        self._add(step, self._text_summary("outputs", f"The run's models and reports:\n\n{listing}"))
        self._writer.flush()

    def logged_rounds(self) -> set[int]:
        return self._earlier_rounds

    @staticmethod
    def _rounds_in(logdir: Path) -> set[int]:
        """The rounds the event files in `logdir` hold (an earlier start of the run wrote them)."""
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        return {event.step for path in sorted(logdir.glob(f"{EVENT_FILE_PREFIX}*"))
                for event in EventFileLoader(str(path)).Load()
                if any(value.tag == ROUND_MARK for value in event.summary.value)}

    def close(self, status: str) -> None:
        self._writer.close()

    def _add(self, step: int, summary: Any) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    @staticmethod
    def _text_summary(tag: str, text: str) -> Any:
        """A text-plugin summary: one string tensor (Markdown), as TensorBoard's Text tab reads it."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode()],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        return Summary(value=[Summary.Value(tag=tag, metadata=meta, tensor=tensor)])
