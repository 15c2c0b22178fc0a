"""A site's part in the federation's feature statistics (`feature_statistics = "federated"` in its config):
its training split's summary to send, and the PS's statistics to keep and standardise with.

The summary holds sums only (counts, sums, sums of squares, a histogram on a fixed grid: schemas/feature_stats.py),
never a patient-level value. The PS's statistics are checked (the channel: schema, topic, the PS's signature;
here: this run, this site's columns) before they are kept, atomically and 0600, in the site's state_dir; the data
pipeline then reads them from there like any statistics file (fedmqtt.data.registry), also after a restart.

Data without per-column statistics (images, ECG records) cannot take part: the site does not stop, it says why in
an "error" status (retained, shown by the PS and the dashboard) and trains nothing, as it would otherwise train on
data the federation did not standardise. `fedmqtt simulate` refuses the same config before it starts.
"""

from __future__ import annotations

from pathlib import Path

from fedmqtt.atomic import write_atomic
from fedmqtt.data.feature_wire import read_statistics_message, summary_message
from fedmqtt.data.registry import site_train_summary
from fedmqtt.data.spec import DataSpec
from fedmqtt.errors import DataError
from schemas.codec import encode
from schemas.feature_stats import FeatureStatistics, FeatureSummary
from site_agent.config import SiteConfig

STATISTICS_FILE = "feature_statistics.msgpack"


class SiteFeatures:
    def __init__(self, config: SiteConfig) -> None:
        self.config = config
        self.enabled = config.feature_statistics == "federated"
        self.path = Path(config.state_dir) / STATISTICS_FILE
        self.held: FeatureStatistics | None = None
        self.problem: str | None = None  # why this site cannot send a summary (`summary_or_problem`)
        if self.enabled and self.path.is_file():
            try:
                self.held = read_statistics_message(self.path)
            except DataError:  # damaged or foreign: asked for again, as if never received
                self.path.unlink()

    @property
    def waiting(self) -> bool:
        """Federated statistics asked for and not held yet: this site must not train."""
        return self.enabled and self.held is None

    def spec(self) -> DataSpec:
        """The data spec the pipeline reads: with the federation's statistics once held."""
        if self.held is None:
            return self.config.data
        return self.config.data.model_copy(update={"statistics": self.path})

    def summary(self) -> FeatureSummary:
        """This site's training split as sums (the split the pipeline makes).

        Raises:
            DataError: data without per-column statistics (images, ECG records).
        """
        c = self.config
        item = site_train_summary(c.data)
        return summary_message(item.summary, item.grid, item.columns, run_id=c.run_id, sender=c.site_id,
                               fixed=item.fixed)

    def summary_or_problem(self) -> FeatureSummary | None:
        """This site's summary; None when its data have none to send, with the reason in `problem`."""
        try:
            return self.summary()
        except DataError as exc:
            self.problem = (f"cannot take part in federated feature statistics (feature_statistics = \"federated\"): "
                            f"{exc}; set feature_statistics = \"site\" in this site's config and in the PS's")
            return None

    def refusal(self, msg: FeatureStatistics, columns: tuple[str, ...]) -> str | None:
        """Why these statistics cannot be used here (None: they can)."""
        if not self.enabled:
            return "this site standardises with its own statistics (feature_statistics = \"site\")"
        if msg.run_id != self.config.run_id:
            return f"statistics of run {msg.run_id!r}"
        if self.config.site_id not in msg.sites:
            return "this site's summary is not in them"
        if tuple(msg.columns) != columns:
            return f"statistics for {len(msg.columns)} other columns than this site's {len(columns)}"
        return None

    def keep(self, msg: FeatureStatistics) -> bool:
        """Store them (atomic, 0600); False if they are the ones held already."""
        if self.held is not None and self.held.model_dump(exclude={"sent_at"}) == msg.model_dump(exclude={"sent_at"}):
            return False
        write_atomic(self.path, encode(msg))
        self.held = msg
        return True
