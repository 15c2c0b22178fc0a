"""Federated feature statistics between numpy and the wire: a site's Summary as a `FeatureSummary` message, the
combination of received summaries into the federation's `FeatureStatistics`, and that message as a file a site
reads (validated like any message from another party: size first, then the schema's checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedmqtt.data.feature_stats import Grid, Statistics, Summary, combine, derive
from fedmqtt.errors import DataError, SchemaError
from schemas.codec import decode, encode
from schemas.feature_stats import FeatureStatistics, FeatureSummary

# A statistics message of MAX_COLUMNS columns is about 0.5 MB of JSON
MAX_STATISTICS_BYTES = 4 * 1024 * 1024


def summary_message(summary: Summary, grid: Grid, columns: Sequence[str], *, run_id: str, sender: str,
                    session: str = "", fixed: Sequence[int] = ()) -> FeatureSummary:
    """What a site sends: its Summary with the grid it was counted on (and the columns left as they are)."""
    return FeatureSummary(
        run_id=run_id, sender=sender, round=0, session=session, columns=tuple(columns), scale=grid.scale,
        low=grid.low, high=grid.high, bins=grid.bins, entries=summary.entries,
        count=tuple(int(v) for v in summary.count), total=tuple(float(v) for v in summary.total),
        total_sq=tuple(float(v) for v in summary.total_sq),
        histogram=tuple(int(v) for v in summary.histogram.reshape(-1)), fixed=tuple(sorted(int(j) for j in fixed)))


def summary_from_message(msg: FeatureSummary) -> tuple[tuple[str, ...], Grid, Summary]:
    """The columns, grid and Summary a (validated) FeatureSummary carries."""
    c = len(msg.columns)
    grid = Grid(tuple(msg.low), tuple(msg.high), tuple(msg.scale), msg.bins)
    summary = Summary(msg.entries, np.array(msg.count, dtype=np.int64), np.array(msg.total, dtype=np.float64),
                      np.array(msg.total_sq, dtype=np.float64),
                      np.array(msg.histogram, dtype=np.int64).reshape(c, msg.bins))
    return tuple(msg.columns), grid, summary


def combine_messages(messages: Sequence[FeatureSummary], *, run_id: str, fixed: Sequence[int] | None = None,
                     session: str = "") -> FeatureStatistics:
    """The PS's step: every site's summary (one per sender, same columns and grid) added up, and the
    federation's statistics derived from the sum. `fixed`: the columns left as they are (None: the ones the
    summaries name, which must agree).

    Raises:
        SchemaError: no summary, two from one site, or summaries of different columns or grids (each would be
            refused by the PS, naming the site).
    """
    if not messages:
        raise SchemaError("no feature summary to combine")
    senders = [m.sender for m in messages]
    if len(set(senders)) != len(senders):
        raise SchemaError(f"two feature summaries from one site: {sorted(senders)}")
    columns, grid, _ = summary_from_message(messages[0])
    parts = []
    for msg in messages:
        _, _, summary = summary_from_message(msg)
        if (why := mismatch(messages[0], msg)) is not None:
            raise SchemaError(f"feature summary of {msg.sender}: {why}")
        parts.append(summary)
    total = combine(parts)
    stats = derive(total, grid, messages[0].fixed if fixed is None else tuple(fixed))
    return statistics_message(stats, columns, tuple(sorted(senders)), entries=total.entries, run_id=run_id,
                              session=session)


def mismatch(first: FeatureSummary, other: FeatureSummary) -> str | None:
    """Why `other` cannot be added to `first` (other columns, grid or fixed columns), or None."""
    if tuple(other.columns) != tuple(first.columns):
        return f"other columns than {first.sender}'s ({len(other.columns)} against {len(first.columns)})"
    if (other.scale, other.low, other.high, other.bins) != (first.scale, first.low, first.high, first.bins):
        return f"another grid (histogram bins) than {first.sender}'s"
    if other.fixed != first.fixed:
        return f"other fixed columns than {first.sender}'s"
    return None


def statistics_message(stats: Statistics, columns: Sequence[str], sites: Sequence[str], *, entries: int,
                       run_id: str, session: str = "") -> FeatureStatistics:
    def bound(v: float) -> float | None:
        return None if not np.isfinite(v) else float(v)

    return FeatureStatistics(
        run_id=run_id, sender="ps", round=0, session=session, columns=tuple(columns), sites=tuple(sites),
        entries=entries, low=tuple(bound(v) for v in stats.low), high=tuple(bound(v) for v in stats.high),
        fill=tuple(float(v) for v in stats.fill), mean=tuple(float(v) for v in stats.mean),
        std=tuple(0.0 if not np.isfinite(v) else float(v) for v in stats.std))


def statistics_from_message(msg: FeatureStatistics) -> Statistics:
    """The numpy Statistics of a (validated) FeatureStatistics: unclipped bounds +-inf, std 0 as inf (zeroed)."""
    low = np.array([-np.inf if v is None else v for v in msg.low])
    high = np.array([np.inf if v is None else v for v in msg.high])
    std = np.array([np.inf if v == 0 else v for v in msg.std])
    return Statistics(low, high, np.array(msg.fill, dtype=np.float64), np.array(msg.mean, dtype=np.float64), std)


def write_statistics(msg: FeatureStatistics, path: Path) -> None:
    Path(path).write_bytes(encode(msg))


def read_statistics_message(path: Path) -> FeatureStatistics:
    """The FeatureStatistics message a file holds, checked like a message from the network.

    Raises:
        DataError: the file is missing, too large, or not a valid FeatureStatistics.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: feature statistics file not found")
    if path.stat().st_size > MAX_STATISTICS_BYTES:
        raise DataError(f"{path}: {path.stat().st_size} bytes, more than a feature statistics file can be")
    try:
        msg = decode(path.read_bytes(), max_bytes=MAX_STATISTICS_BYTES)
    except SchemaError as exc:
        raise DataError(f"{path}: not valid feature statistics: {exc}") from None
    if not isinstance(msg, FeatureStatistics):
        raise DataError(f"{path}: a {msg.kind} message, not feature_statistics")
    return msg


def read_statistics(path: Path, columns: Sequence[str]) -> Statistics:
    """The federation's statistics from a file, checked like a message from the network, for these columns.

    Raises:
        DataError: the file is missing, too large, not a valid FeatureStatistics, or for other columns.
    """
    msg = read_statistics_message(path)
    if tuple(msg.columns) != tuple(columns):
        raise DataError(f"{path}: statistics for columns {list(msg.columns)[:5]}..., this site has "
                        f"{list(columns)[:5]}... ({len(msg.columns)} against {len(columns)})")
    return statistics_from_message(msg)
