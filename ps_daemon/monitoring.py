"""What the PS's Prometheus endpoint reports, as plain numbers: one immutable `PsSnapshot` built from the runner's
state and counters, and the catalogue of the metrics (`METRICS`). No prometheus import here:
`ps_daemon.metrics_endpoint` turns a snapshot into metrics, and `ps_daemon.metrics_hooks` imports it only when the
config asks for an endpoint.

Why snapshots: the loop owns every counter it reads (dicts it mutates while messages arrive), and the HTTP
server answers scrapes from its own thread. The loop builds a fresh snapshot at most every SAMPLE_EVERY_S and
swaps it in with one assignment; a scrape only ever reads a finished one.

Labels stay bounded whatever arrives: a site label is one of the configured sites or "other", a reason one of
the known refusal categories or "other" (a hostile sender cannot grow the series count).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, get_args

from fedmqtt.transport import channel as ch
from fedmqtt.transport import signing
from fedmqtt.transport.bulk import TransferStats
from ps_daemon.config import DaemonConfig
from ps_daemon.participant_spent import spent_in_run
from ps_daemon.refusals import FEATURE_SUMMARY_REFUSED, REFUSAL_CATEGORIES, refusal_category
from ps_daemon.state import DaemonState, Phase, RoundRecord
from ps_daemon.status import StatusBoard
from ps_daemon.turns import UploadTurns
from schemas import codec, envelope

PHASES: tuple[str, ...] = get_args(Phase)
OTHER = "other"  # the label of a sender outside the site list, or of a reason not known here
SAMPLE_EVERY_S = 0.25  # the loop may turn many times a second; a scrape rarely comes more than every few seconds
# Round lengths run from under a second (a small model on one host) to hours (images at hospitals).
ROUND_SECONDS_BUCKETS: tuple[float, ...] = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600)
# Every category a refusal can be counted under: the PS's own (ps_daemon.refusals, inbound's literals) and the
# channel's and codec's checks. One that is added elsewhere and not here is counted as "other" until it is.
KNOWN_REASONS: frozenset[str] = frozenset(
    {label for _, label in REFUSAL_CATEGORIES}
    | {refusal_category(""), "unusable content", "bad histogram", FEATURE_SUMMARY_REFUSED}
    | {codec.TOO_LARGE, codec.TOO_DEEP, codec.MALFORMED, codec.WRONG_VERSION, codec.SCHEMA, codec.NON_FINITE,
       codec.OUT_OF_RANGE, codec.TENSOR_LAYOUT}
    | {ch.BAD_TOPIC, ch.WRONG_RUN, ch.WRONG_TOPIC, ch.WRONG_SENDER, ch.WRONG_ADDRESS, ch.MANIFEST_REFUSED,
       ch.OVER_BUDGET, ch.TRANSFER_FAILED, ch.MISMATCH, ch.INTERNAL}
    | {envelope.UNSIGNED, signing.BAD_SIGNATURE, signing.UNKNOWN_KEY, signing.WRONG_SIGNER})


@dataclass(frozen=True)
class MetricDoc:
    """One exported metric family: its Prometheus type, label names and help text (docs/monitoring.md's table is
    rendered from these, and the endpoint's HELP lines are these)."""

    kind: Literal["gauge", "counter", "histogram", "summary", "info"]
    labels: tuple[str, ...]
    help: str


_PS = "fedmqtt_ps_"
# Family names as prometheus_client takes them: a counter's samples get `_total`, an info's `_info`.
METRICS: dict[str, MetricDoc] = {
    _PS + "run": MetricDoc("info", ("run_id", "algorithm", "session"), "the run this PS serves and this start's "
                           "session (a --resume keeps it)"),
    _PS + "round": MetricDoc("gauge", (), "the round being trained: 0 before round 1, rounds_planned + 1 from "
                             "the final evaluation on"),
    _PS + "rounds_planned": MetricDoc("gauge", (), "training rounds in the config (`rounds`)"),
    _PS + "rounds_closed": MetricDoc("counter", (), "rounds closed so far (a --resume continues the count)"),
    _PS + "phase": MetricDoc("gauge", ("phase",), "1 for the phase the PS is in, 0 for the others: "
                             + ", ".join(PHASES)),
    _PS + "sites_configured": MetricDoc("gauge", (), "sites in the config's `sites` list"),
    _PS + "sites_online": MetricDoc("gauge", (), "configured sites whose last status says online"),
    _PS + "site_online": MetricDoc("gauge", ("site",), "1 while that site is online, else 0"),
    _PS + "sites_selected": MetricDoc("gauge", (), "sites asked to answer the open round (or the final "
                                      "evaluation)"),
    _PS + "round_answers": MetricDoc("gauge", (), "updates (or final reports) accepted in the open round so far"),
    _PS + "round_deadline_timestamp_seconds": MetricDoc("gauge", (), "Unix time of the open round's deadline "
                                                        "(absent when none)"),
    _PS + "last_progress_timestamp_seconds": MetricDoc("gauge", (), "Unix time the open round last started or "
                                                       "got an answer (a stall shows as a growing gap)"),
    _PS + "round_duration_seconds": MetricDoc("histogram", (), "how long closed rounds took, open to close"),
    _PS + "last_round_duration_seconds": MetricDoc("gauge", (), "how long the last closed round took"),
    _PS + "last_round_val_metric": MetricDoc("gauge", ("metric",), "mean validation value of the run's "
                                             "selection metric in the last closed round (absent when undefined)"),
    _PS + "last_round_train_loss": MetricDoc("gauge", (), "mean training loss of the last closed round (absent "
                                             "when undefined)"),
    _PS + "best_round": MetricDoc("gauge", (), "the best round so far by the selection metric (absent until one)"),
    _PS + "updates_accepted": MetricDoc("counter", ("site",), "updates aggregated into a closed round"),
    _PS + "updates_no_step": MetricDoc("counter", ("site",), "answers without a training step (the site could not "
                                       "take one) in closed rounds"),
    _PS + "stragglers": MetricDoc("counter", ("site",), "closed rounds a site was selected for and did not "
                                  "answer"),
    _PS + "refused": MetricDoc("counter", ("site", "reason"), "messages refused, by sender and category: the "
                               "channel's checks (malformed, wrong sender, ...) and the PS's (wrong round, "
                               "duplicate, ...); site `other` is a sender outside the site list"),
    _PS + "messages_received": MetricDoc("counter", (), "MQTT messages received, chunks included"),
    _PS + "messages_duplicate": MetricDoc("counter", (), "messages and chunked transfers dropped as already seen"),
    _PS + "bytes_sent": MetricDoc("counter", (), "payload bytes published (both connections)"),
    _PS + "bytes_received": MetricDoc("counter", (), "payload bytes received (both connections)"),
    _PS + "broker_connected": MetricDoc("gauge", (), "1 while the control connection to the broker is up"),
    _PS + "broker_connects": MetricDoc("counter", (), "connections made to the broker (more than 1: reconnects)"),
    _PS + "chunks_received": MetricDoc("counter", (), "chunks of chunked transfers received"),
    _PS + "chunk_problems": MetricDoc("counter", ("problem",), "chunks dropped: duplicate, stale (of no current "
                                      "transfer) or corrupt (failed the digest)"),
    _PS + "chunk_refetches": MetricDoc("counter", (), "times missing or corrupt chunks were asked for again"),
    _PS + "chunked_transfers": MetricDoc("counter", ("result",), "chunked transfers completed or failed"),
    _PS + "upload_turns": MetricDoc("gauge", (), "upload turns granted now (at most `upload_turns`)"),
    _PS + "checkpoint_save_seconds": MetricDoc("summary", (), "time to save a checkpoint (best-round file "
                                               "included)"),
    _PS + "checkpoint_last_save_seconds": MetricDoc("gauge", (), "time the last checkpoint took to save"),
    _PS + "privacy_epsilon": MetricDoc("gauge", (), "privacy budget spent so far; not exported until the PS has "
                                       "a privacy accountant (never a placeholder value)"),
}


@dataclass
class DurationTally:
    """Count, sum and last value of a repeated operation's duration (e.g. saving a checkpoint)."""

    count: int = 0
    total_s: float = 0.0
    last_s: float | None = None

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.last_s = seconds

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Time the block; one that raises is not counted (the PS stops on it anyway)."""
        started = time.perf_counter()
        yield
        self.add(time.perf_counter() - started)


@dataclass(frozen=True)
class Buckets:
    """A histogram's content: cumulative counts at each upper bound (the +Inf bucket is `count`)."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    count: int
    total: float


@dataclass(frozen=True)
class PsSnapshot:
    """The PS at one moment, in the terms the endpoint exports (docs/monitoring.md lists the metrics)."""

    run_id: str
    algorithm: str
    session: str
    sites: tuple[str, ...]  # configured, sorted
    rounds_planned: int
    selection_metric: str
    phase: str
    round: int
    online: frozenset[str]
    selected: int
    round_answers: int  # updates (or final reports) in the open round so far
    deadline: float | None
    last_progress: float | None
    rounds_closed: int
    accepted: Mapping[str, int]  # site -> updates aggregated in closed rounds
    no_step: Mapping[str, int]  # site -> answers without a training step in closed rounds
    stragglers: Mapping[str, int]  # site -> closed rounds it was selected for and did not answer
    round_seconds: Buckets
    last_round_seconds: float | None
    last_round_metric: float | None  # mean validation value of `selection_metric` in the last closed round
    last_round_train_loss: float | None
    best_round: int | None
    refused: Mapping[tuple[str, str], int]  # (site, reason) -> messages refused
    messages_received: int
    duplicates: int
    bytes_sent: int
    bytes_received: int
    broker_connected: bool
    broker_connects: int
    transfers: TransferStats
    upload_turns: int
    checkpoints: DurationTally
    # Privacy budget spent so far, once the PS has a privacy accountant; None (and no metric at all) until then.
    epsilon: float | None = None


def site_label(sender: str, sites: frozenset[str] | tuple[str, ...]) -> str:
    return sender if sender in sites else OTHER


def reason_label(category: str) -> str:
    return category if category in KNOWN_REASONS else OTHER


def refused_by_label(sources: list[Mapping[str, Counter[str]]],
                     sites: tuple[str, ...]) -> dict[tuple[str, str], int]:
    """Sum sender -> category -> count tables into (site label, reason label) -> count."""
    out: Counter[tuple[str, str]] = Counter()
    for source in sources:
        for sender, reasons in list(source.items()):
            for category, n in list(reasons.items()):
                out[(site_label(sender, sites), reason_label(category))] += n
    return dict(out)


def privacy_spent(config: DaemonConfig, state: DaemonState) -> float | None:
    """The participant-level epsilon the released models have cost so far: exactly what ps/status says
    (DaemonStatus.participant_dp, from ps_daemon.participant_spent.spent_in_run), read from the closed rounds'
    records, which checkpoints keep, so it survives a `--resume`. None when the run has no DP server rule, or the
    status shows no spending (none charged yet, or a record it cannot show): the endpoint then exports no epsilon
    rather than a made-up 0 or infinity. Record-level epsilon is each site's own and is in ps/status per site, not
    in this run-wide gauge."""
    spent = spent_in_run(config, state.history)
    return None if spent is None else spent.epsilon


@dataclass
class _ClosedRounds:
    """What the closed rounds of the history add up to."""

    folded: int = 0  # history records counted so far
    accepted: Counter[str] = field(default_factory=Counter)
    no_step: Counter[str] = field(default_factory=Counter)
    stragglers: Counter[str] = field(default_factory=Counter)
    per_bucket: list[int] = field(default_factory=lambda: [0] * len(ROUND_SECONDS_BUCKETS))
    count: int = 0
    total_s: float = 0.0

    def fold(self, record: RoundRecord, sites: tuple[str, ...]) -> None:
        self.accepted.update(site_label(s, sites) for s in record.sites)
        self.no_step.update(site_label(s, sites) for s in record.skipped)
        self.stragglers.update(site_label(s, sites) for s in record.stragglers)
        seconds = max(0.0, record.closed_at - record.started_at)
        self.count += 1
        self.total_s += seconds
        slot = next((i for i, bound in enumerate(ROUND_SECONDS_BUCKETS) if seconds <= bound), None)
        if slot is not None:  # longer than the last bound: only in the +Inf bucket (`count`)
            self.per_bucket[slot] += 1
        self.folded += 1

    def buckets(self) -> Buckets:
        running, cumulative = 0, []
        for n in self.per_bucket:
            running += n
            cumulative.append(running)
        return Buckets(ROUND_SECONDS_BUCKETS, tuple(cumulative), self.count, self.total_s)


class _Timed(Protocol):
    @property
    def checkpoint_time(self) -> DurationTally: ...


class MonitoredPs(Protocol):
    """What the endpoint reads from the PS (the runner; named by shape, so this module need not import it)."""

    @property
    def state(self) -> DaemonState: ...

    @property
    def channel(self) -> ch.Channel: ...

    @property
    def status(self) -> StatusBoard: ...

    @property
    def turns(self) -> UploadTurns: ...

    @property
    def outbound(self) -> _Timed: ...


class SnapshotBuilder:
    """Builds snapshots; folds each closed round of the history in once (a run may have 100 000 rounds)."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self._rounds = _ClosedRounds()

    def _closed_rounds(self, state: DaemonState) -> _ClosedRounds:
        if len(state.history) < self._rounds.folded:  # another state's history (never within one start)
            self._rounds = _ClosedRounds()
        for record in state.history[self._rounds.folded:]:
            self._rounds.fold(record, self.config.sorted_sites)
        return self._rounds

    def build(self, state: DaemonState, *, channel_stats: ch.ChannelStats, transfers: TransferStats,
              ps_refusals: Mapping[str, Counter[str]], bytes_sent: int, bytes_received: int,
              broker_connected: bool, broker_connects: int, upload_turns: int,
              checkpoints: DurationTally) -> PsSnapshot:
        c = self.config
        rounds = self._closed_rounds(state)
        last = state.history[-1] if state.history else None
        answered = state.updates if state.phase == "training" else state.final_reports
        metric = last.mean.get(c.selection_metric) if last is not None else None
        return PsSnapshot(
            run_id=c.run_id, algorithm=c.algorithm, session=state.session, sites=c.sorted_sites,
            rounds_planned=c.rounds, selection_metric=c.selection_metric, phase=state.phase, round=state.round,
            online=frozenset(s for s in state.online if s in c.sites), selected=len(state.selected),
            round_answers=len(answered) if state.phase in ("training", "evaluating") else 0,
            deadline=state.deadline, last_progress=state.last_progress or None, rounds_closed=len(state.history),
            accepted=dict(rounds.accepted), no_step=dict(rounds.no_step), stragglers=dict(rounds.stragglers),
            round_seconds=rounds.buckets(),
            last_round_seconds=max(0.0, last.closed_at - last.started_at) if last is not None else None,
            last_round_metric=metric, last_round_train_loss=last.train_loss if last is not None else None,
            best_round=state.best.round if state.best is not None else None,
            refused=refused_by_label([channel_stats.rejected_by_site, ps_refusals], c.sorted_sites),
            messages_received=channel_stats.received, duplicates=channel_stats.duplicates,
            bytes_sent=bytes_sent, bytes_received=bytes_received, broker_connected=broker_connected,
            broker_connects=broker_connects, transfers=replace(transfers), upload_turns=upload_turns,
            checkpoints=replace(checkpoints), epsilon=privacy_spent(c, state))

    def from_ps(self, ps: MonitoredPs) -> PsSnapshot:
        channel = ps.channel
        return self.build(
            ps.state, channel_stats=channel.stats, transfers=channel.fetcher.stats,
            ps_refusals=ps.status.rejections, bytes_sent=channel.bytes_sent,
            bytes_received=channel.bytes_received, broker_connected=bool(channel.transport.connected),
            broker_connects=channel.transport.connects, upload_turns=len(ps.turns.view()),
            checkpoints=ps.outbound.checkpoint_time)
