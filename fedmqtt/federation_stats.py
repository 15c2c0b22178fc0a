"""A simulation's federated feature statistics (`feature_statistics` in its config): every site's training sums
as the `feature_summary` message it would send, through the codec's checks, combined by the same step the PS
takes (fedmqtt.data.feature_wire.combine_messages), and the federation's statistics written into the run folder,
where every site, the pooled reference and the held-out scoring read them (the sites' `statistics`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fedmqtt.data.feature_stats import SMALL_SITE_ROWS
from fedmqtt.data.feature_wire import combine_messages, summary_message, write_statistics
from fedmqtt.data.registry import TrainSummary, site_train_summary
from fedmqtt.errors import ConfigError, DataError
from schemas.codec import decode, encode
from schemas.feature_stats import FeatureSummary

if TYPE_CHECKING:
    from fedmqtt.simulation_config import SimulationConfig

STATISTICS_FILE = "feature_statistics.json"


def with_federation_statistics(config: SimulationConfig) -> SimulationConfig:
    """`config` with every site reading the federation's statistics, when its `feature_statistics` asks for
    them (always with "federated"; with "auto" when a site has fewer than SMALL_SITE_ROWS training rows and
    the data has columns to summarise); else `config` unchanged. Sites that name a statistics file already
    keep it.

    Raises:
        ConfigError: "federated" for data without per-column statistics (images, ECG records).
    """
    if config.feature_statistics == "site" or any(s.statistics is not None for s in config.sites.values()):
        return config
    try:
        summaries = {site: site_train_summary(spec) for site, spec in sorted(config.sites.items())}
    except DataError as exc:
        if config.feature_statistics == "auto":
            return config
        raise ConfigError(f"feature_statistics = \"federated\": {exc}") from None
    if config.feature_statistics == "auto" and min(s.n_train for s in summaries.values()) >= SMALL_SITE_ROWS:
        return config
    path = federation_statistics(config.run_id, summaries, Path(config.out_dir))
    sites = {site: spec.model_copy(update={"statistics": path}) for site, spec in config.sites.items()}
    return config.model_copy(update={"sites": sites})


def federation_statistics(run_id: str, summaries: dict[str, TrainSummary], out_dir: Path) -> Path:
    """Each site's summary encoded and decoded as on the wire, combined, written to out_dir/STATISTICS_FILE."""
    received = []
    for site, item in summaries.items():
        msg = decode(encode(summary_message(item.summary, item.grid, item.columns, run_id=run_id, sender=site,
                                            fixed=item.fixed)))
        if not isinstance(msg, FeatureSummary):  # decode gives back the kind encode was given
            raise DataError(f"site {site}: its feature summary decoded as {msg.kind}")
        received.append(msg)
    stats = combine_messages(received, run_id=run_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = (out_dir / STATISTICS_FILE).resolve()
    write_statistics(stats, path)
    return path
